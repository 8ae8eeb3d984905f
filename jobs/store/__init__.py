"""The database layer shared by api/ and jobs/: settings, tables, sessions and data access. Torch-free."""
