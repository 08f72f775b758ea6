"""The baselines WIDE is compared with in §4.1: SkipGPT (dynamic depth) and static width pruning."""
