"""Weight-version policies for asynchronous pipelines: predictors (PipeOptim, SpecTrain) and stashing."""
from .predictors import (AdamPredictor, LastUpdate, Predictor, RMSpropPredictor, SGDPredictor, SmoothedGradient,
                         make_predictor, register_predictor)
from .versions import WeightVersions

__all__ = ["AdamPredictor", "LastUpdate", "Predictor", "RMSpropPredictor", "SGDPredictor", "SmoothedGradient",
           "WeightVersions", "make_predictor", "register_predictor"]
