"""Post-hoc analysis of trained QSV models: routing entropy, rotation angles and
test-time interventions (:mod:`.routing`) of a model rebuilt from its checkpoint
(:mod:`.loading`); CLI: ``examples/analyze.py``."""
from .loading import load_model
from .routing import (
    INTERVENTIONS,
    NotQSVModelError,
    capture_layer_inputs,
    intervene,
    intervention_accuracy,
    qsv_layers,
    rotation_angles,
    routing_statistics,
    summarize_angles,
)

__all__ = [
    "INTERVENTIONS",
    "NotQSVModelError",
    "capture_layer_inputs",
    "intervene",
    "intervention_accuracy",
    "load_model",
    "qsv_layers",
    "rotation_angles",
    "routing_statistics",
    "summarize_angles",
]
