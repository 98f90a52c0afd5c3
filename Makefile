# The two commands: `make demo` runs the main job, `make test` runs every test.
# Both set up their own virtual environment on first use (torch pinned to the CPU wheel).
# MCORE=0.19.2 selects megatron-core 0.19.2 (in .venv-mcore0.19).
MCORE ?= 0.16.1
export MCORE

.PHONY: demo test setup clean

setup:
	@scripts/bootstrap.sh

# ARGS: extra flags for the demo script, e.g. make demo ARGS="--steps 5 --no-flat-sco".
demo:
	@scripts/demo.sh $(ARGS)

test:
	@scripts/test.sh

clean:
	rm -rf .venv .venv-mcore* *.egg-info results
