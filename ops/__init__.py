"""Operations tooling: Terraform modules, KubeRay manifests and their offline checks."""
