"""Custom checkov policies for shardserve's GPU rules (loaded with --external-checks-dir ops/checkov)."""
