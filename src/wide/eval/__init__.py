"""Evaluation: perplexity, the lm-eval model, zero-shot tasks, routing plots."""
