"""rloo-kfp: RLHF with REINFORCE Leave-One-Out (RLOO), shipped as a Kubeflow pipeline."""

__version__ = "0.2.0"
