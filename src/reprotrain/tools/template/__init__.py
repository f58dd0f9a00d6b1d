"""Which files are the framework's, and making / updating a project from the template."""
