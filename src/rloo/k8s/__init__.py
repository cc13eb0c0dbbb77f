"""Kubernetes plumbing, nothing about RL: what a pod asks for and may be given (:mod:`rloo.k8s.resources`), the
multi-node job's manifest as a pure function of its spec (:mod:`rloo.k8s.builders`: a Kubeflow Trainer
``TrainJob`` or a training-operator ``PyTorchJob``, running the command its caller builds), that job's life on
the cluster (:mod:`rloo.k8s.jobs`: create or adopt, follow, wait, clean up), the cluster's pull secrets,
environment and CA bundle for the pods (:mod:`rloo.k8s.platform`), and what an image reference is
(:mod:`rloo.k8s.images`).

Import the modules, not this package: it stays empty so that importing one (say, in a pipeline step that runs
in the slim image) pulls in nothing else. Only the Kubernetes and Kubeflow clients, imported where they are
called, come from outside the standard library.
"""
