provider "aws" {
  region = var.region
}

# Both Kubernetes providers authenticate with a short-lived token from the AWS CLI.
provider "kubernetes" {
  host                   = module.gpu_cluster.cluster_endpoint
  cluster_ca_certificate = base64decode(module.gpu_cluster.cluster_certificate_authority_data)

  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.gpu_cluster.cluster_name, "--region", var.region]
  }
}

provider "helm" {
  kubernetes {
    host                   = module.gpu_cluster.cluster_endpoint
    cluster_ca_certificate = base64decode(module.gpu_cluster.cluster_certificate_authority_data)

    exec {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", module.gpu_cluster.cluster_name, "--region", var.region]
    }
  }
}
