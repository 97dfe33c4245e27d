# Quick start: `make demo` (set up, then run the Ray job on the sample prompts), `make test`.
.PHONY: setup demo test test-fast bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python jobs/generate.py --input data/sample_prompts.jsonl --output out/sample

test: setup
	.venv/bin/python -m pytest -q -ra --durations=15

test-fast: setup
	LOGITSPEC_SKIP_SLOW=1 .venv/bin/python -m pytest -q -ra -m "not slow"

bench: setup
	.venv/bin/logitspec bench --quick --out out/bench-quick
