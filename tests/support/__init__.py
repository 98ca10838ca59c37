"""What tests share besides fixtures (tests/conftest.py): the repository's paths and the helpers
that build tiny models (models), tiny worlds and training runs (train_helpers), the extraction
case (extract_helpers), stage argvs and in-process runs (stages), Snakemake runs (workflow), vLLM
environments (vllm_helpers) and published templates (template_cases)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
