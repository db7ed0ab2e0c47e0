"""Serving: an inference server (vLLM) and what sits in front of it.

``vllm`` starts and drives the vLLM subprocess (``vllm_plugin/`` and ``templates/`` travel with
it); ``gateway`` is the OpenAI-compatible proxy that records every completion's tokens;
``router`` deploys each trained step's adapter; ``replicas`` spreads rollouts over several
servers; ``merge`` folds an adapter into the base weights for merged serving; ``gpu_memory`` sizes
each server's share of a GPU beside the trainer.
"""
