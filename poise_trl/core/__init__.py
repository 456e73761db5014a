"""Pure math and plumbing used everywhere: estimators, metrics, provenance, loading."""
