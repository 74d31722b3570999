"""Reinforcement learning (GRPO) for omniweave models.

``grpo`` holds the math as pure tensor functions (advantages, clipped policy loss, KL,
aggregation, entropy) and ``rewards`` the reward functions scored on decoded responses. Neither
knows about processes or meshes: the training loop sums their numerators and denominators over
ranks, the same way the SFT loss stays layout-independent.
"""
