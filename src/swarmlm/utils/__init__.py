"""Small shared utilities: child processes that die with their parent."""
