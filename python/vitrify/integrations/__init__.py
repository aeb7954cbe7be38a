"""Optional integrations (torch, SGLang). Each imports its framework lazily."""
