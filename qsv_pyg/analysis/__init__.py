"""Post-hoc analysis of trained QSV models: routing entropy, rotation angles and
test-time interventions (:mod:`.routing`) of a model rebuilt from its checkpoint
(:mod:`.loading`); CLI: ``examples/analyze.py``."""
from .loading import load_model
from .routing import (
    INTERVENTION_ALIASES,
    INTERVENTIONS,
    NotQSVModelError,
    capture_layer_inputs,
    intervene,
    intervention_accuracy,
    intervention_name,
    interventions_of,
    qsv_layers,
    rotation_angles,
    routing_statistics,
    summarize_angles,
)

__all__ = [
    "INTERVENTION_ALIASES",
    "INTERVENTIONS",
    "NotQSVModelError",
    "capture_layer_inputs",
    "intervene",
    "intervention_accuracy",
    "intervention_name",
    "interventions_of",
    "load_model",
    "qsv_layers",
    "rotation_angles",
    "routing_statistics",
    "summarize_angles",
]
