# Quick start: `make demo` (set up, then run the Ray job on the demo's prompts), `make test`.
.PHONY: setup demo test test-fast bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python jobs/generate.py --input data/demo/prompts.jsonl --output out/sample

test: setup
	.venv/bin/python -m pytest -q -ra --durations=15

test-fast: setup
	LOGITSPEC_SKIP_SLOW=1 .venv/bin/python -m pytest -q -ra -m "not slow"

# Spec-Bench's question.jsonl is not shipped in this repository: by default it is read beside the checkout
QUESTIONS ?= ../shared/data/spec_bench/question.jsonl

bench: setup
	@test -f "$(QUESTIONS)" || { echo "make bench: $(QUESTIONS) not found (Spec-Bench's question.jsonl, not shipped here); run make bench QUESTIONS=/path/to/question.jsonl" >&2; exit 2; }
	.venv/bin/logitspec bench --quick --questions "$(QUESTIONS)" --out out/bench-quick
