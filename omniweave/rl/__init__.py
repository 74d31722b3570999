"""Reinforcement learning (GRPO) for omniweave models.

``grpo`` holds the math as pure tensor functions (advantages, clipped policy loss, KL,
aggregation, entropy), ``rewards`` the reward functions scored on decoded responses and
``answers`` how they read an answer (``<answer>`` tags, option letters, numbers). None of them
knows about processes or meshes: the training loop sums grpo's numerators and denominators over
ranks, the same way the SFT loss stays layout-independent.
"""
