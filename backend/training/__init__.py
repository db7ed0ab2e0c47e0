"""Training: the GRPO LoRA trainer and its parts.

``trainer`` runs a step (load, forward, loss, backward, checkpoint); ``loss`` holds the policy
losses by name; ``batch`` packs trajectories into token batches; ``fused_lora`` is the CPU LoRA
kernel; ``distributed`` runs the same step on several ranks.
"""
