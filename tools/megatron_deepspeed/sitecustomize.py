"""CPU/offline shims for running Megatron-DeepSpeed's unchanged ``pretrain_gpt.py`` under stock DeepSpeed.

``run.py`` puts this directory first on PYTHONPATH, so every rank the DeepSpeed launcher starts runs this
file at interpreter start-up; nothing in the Megatron-DeepSpeed tree is edited. Each shim below is a CPU/offline,
version-skew or comparability matter and has nothing to do with ds_chimera. Shims that touch Megatron or
DeepSpeed are applied lazily, right after the module they patch is first imported (``_after_import``),
so start-up imports nothing heavy and ``prepare.py``'s tools are unaffected.

``MDS_CHIMERA=1``: ``import ds_chimera`` (installs its ``deepspeed.initialize`` switch), so the same
harness runs ds_chimera; the schedule itself comes from the DeepSpeed JSON config's "pipeline" section.
``MDS_SHIMS_OFF=name,...`` turns single shims off (to show why each is needed).
"""
import importlib.abc
import os
import sys

_OFF = set(filter(None, os.environ.get("MDS_SHIMS_OFF", "").split(",")))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``fn(module)`` once, right after ``name`` has been imported (its real loader, wrapped)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, fn = spec.loader.exec_module, self.fn

        def run_then_patch(module):
            exec_module(module)
            fn(module)
        spec.loader.exec_module = run_then_patch
        return spec


def _after_import(name, fn, shim):
    if shim in _OFF:
        return
    if name in sys.modules:
        fn(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, fn))


def _seed_layers(gpt_model):
    """shim ``seed_layers``: GPTModelPipe calls ``PipelineModule.__init__`` without ``seed_layers``, so stock
    DeepSpeed builds each stage's layers from whatever the global RNG holds when that rank gets to them: the
    initial weights then depend on how the layers are split over the stages. With ``seed_layers=True`` (a
    DeepSpeed option) layer i is built right after ``set_random_seed(base_seed + i)``, as ds_chimera builds
    every LayerSpec under ``torch.manual_seed(base_seed + i)`` (a tied layer at its first index; stock
    DeepSpeed broadcasts the tied weight from that same first stage). The initial model is then the same
    whatever the stage split or schedule, so runs compare. Needs ``--use-cpu-initialization`` (run.py passes
    it): Megatron's default init draws from its model-parallel RNG tracker, whose state runs on across all the
    layers a rank builds and is not reached by the per-layer seed."""
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.pipe.module import PipelineModule
    init = PipelineModule.__init__
    if getattr(init, "_mds_seed_layers", False):
        return

    def seed_fn(seed):
        # DeepSpeed's default seeding, ds_utils.set_random_seed(base_seed + layer_idx), raises TypeError here:
        # with partition_method 'type:...' (GPTModelPipe's) or 'parameters' the stage bounds come from
        # partition_balanced as numpy.int64, and Python 3.11's random.seed refuses those. Same seeding, int seed.
        ds_utils.set_random_seed(int(seed))

    def __init__(self, *args, **kwargs):
        if isinstance(self, gpt_model.GPTModelPipe):
            kwargs.setdefault("seed_layers", True)
            kwargs.setdefault("seed_fn", seed_fn)
        init(self, *args, **kwargs)
    __init__._mds_seed_layers = True
    PipelineModule.__init__ = __init__


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty stand-ins for modules that are imported at module level on the GPT path but never used there.
    Appended to the end of ``sys.meta_path``, so a real module, when one is installed, always wins."""

    def __init__(self):
        self.modules = {}          # name -> function filling the module

    def add(self, shim, names_fill):
        if shim not in _OFF:
            self.modules.update(names_fill)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules:
            return None
        import importlib.machinery
        is_pkg = any(name.startswith(fullname + ".") for name in self.modules)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module._mds_stub = True
        self.modules[module.__name__](module)


def _stub_error(what):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a stub here (tools/megatron_deepspeed/sitecustomize.py)")
    return fail


def _fill_torchvision_datasets(module):
    class VisionDataset:                 # base class of megatron.data.image_folder.DatasetFolder
        __init__ = _stub_error("torchvision")
    module.VisionDataset = VisionDataset


def _fill_compress(module):
    module.init_compression = _stub_error("deepspeed.compression.compress.init_compression")
    module.redundancy_clean = _stub_error("deepspeed.compression.compress.redundancy_clean")


_STUBS = _Stubs()
# shim ``torchvision``: megatron/training.py imports the ViT/DINO code at module level
# (megatron.model.vision.knn_monitor -> megatron.data.vit_dataset, image_folder), which imports
# torchvision.transforms and torchvision.datasets and subclasses VisionDataset. torchvision is not installed
# here, and the only wheels for this torch are CUDA builds whose ops do not load on the CPU torch. GPT
# pretraining never calls into it: empty modules (and a VisionDataset base class that fails if instantiated).
_STUBS.add("torchvision", {"torchvision": lambda m: None, "torchvision.transforms": lambda m: None,
                           "torchvision.datasets": _fill_torchvision_datasets})
# shim ``compress``: megatron/training.py does ``from deepspeed.compression.compress import init_compression,
# redundancy_clean`` at module level; DeepSpeed 0.19.8 no longer ships that module (deepspeed.compression holds
# only helper.py): a version skew between Megatron-DeepSpeed HEAD and the installed DeepSpeed. Both functions
# run only with "compression_training" in the DeepSpeed config, which no config here has; they fail if called.
_STUBS.add("compress", {"deepspeed.compression.compress": _fill_compress})
sys.meta_path.append(_STUBS)


_after_import("megatron.model.gpt_model", _seed_layers, "seed_layers")


def _fp16_on_cpu(cpu_accelerator):
    """shim ``fp16_on_cpu`` (run.py --fp16): DeepSpeed's CPU accelerator reports no fp16, so DeepSpeed's engine
    refuses "fp16" (and ds_chimera refuses fp16 with ZeRO-1, whose optimizer is DeepSpeed's). torch's CPU kernels
    run fp16, so the report is lifted for the stock engine and ds_chimera's alike, which makes the run possible on
    this host; a GPU accelerator reports fp16 itself."""
    cpu_accelerator.CPU_Accelerator.is_fp16_supported = lambda self: True


if os.environ.get("MDS_FP16_ON_CPU") == "1":
    _after_import("deepspeed.accelerator.cpu_accelerator", _fp16_on_cpu, "fp16_on_cpu")

if os.environ.get("MDS_CHIMERA") == "1":
    import ds_chimera  # noqa: F401  (only an import hook until deepspeed is imported)
