"""The InferenceDeployment custom resource: pydantic models (the single source of truth), the generated CRD, semantic validation."""
