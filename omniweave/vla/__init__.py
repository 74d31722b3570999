"""Vision-language-action demo: a synthetic language-conditioned reaching task (``sim``), its expert
demonstrations as a LeRobot v3.0 dataset (``demo_data``) and a closed-loop evaluator (``evaluate``)
that a trained policy plugs into. Everything here is numpy on CPU, so tests and the demo run anywhere.
"""
