.PHONY: demo test complete bench
demo:
	bash scripts/dev.sh demo
test:
	bash scripts/dev.sh test
complete:
	bash scripts/dev.sh complete
bench:
	bash scripts/dev.sh bench
