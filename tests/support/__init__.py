"""What tests share besides fixtures (tests/conftest.py): the repository's paths and the helpers
that build tiny worlds (train_helpers), vLLM environments (vllm_helpers) and published templates
(template_cases)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
