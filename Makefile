.PHONY: demo test bench
demo:
	bash scripts/dev.sh demo
test:
	bash scripts/dev.sh test
bench:
	bash scripts/dev.sh bench
