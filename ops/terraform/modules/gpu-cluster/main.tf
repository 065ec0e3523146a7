# An EKS cluster with a CPU system node group and one GPU node group sized for shardserve replicas.
# GPU nodes carry the taint nvidia.com/gpu=true:NoSchedule, so only pods that tolerate it (the
# RayService GPU workers, the NVIDIA device plugin) land there.

data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394: only the first three zone names (sorted) are used; zones AWS adds later do not move the VPC
  state = "available"

  filter {
    name   = "opt-in-status"
    values = ["opt-in-not-required"]
  }
}

data "aws_region" "current" {}

locals {
  gpu_instance_type  = var.gpu_instance_types[tostring(var.tensor_parallel_size)]
  azs                = slice(data.aws_availability_zones.available.names, 0, 3)
  vpc_id             = var.create_vpc ? module.vpc[0].vpc_id : var.existing_vpc_id
  private_subnet_ids = var.create_vpc ? module.vpc[0].private_subnets : var.existing_private_subnet_ids
}

# Plan-time guards for what the variable blocks cannot compare (one variable against another).
resource "terraform_data" "sizing_guards" {
  input = {
    gpu_instance_type = local.gpu_instance_type
  }

  lifecycle {
    precondition {
      condition     = var.gpu_node_min_size <= var.gpu_node_max_size
      error_message = "gpu_node_min_size must not exceed gpu_node_max_size."
    }
    precondition {
      condition     = var.system_node_min_size <= var.system_node_max_size
      error_message = "system_node_min_size must not exceed system_node_max_size."
    }
    precondition {
      condition     = var.create_vpc || (var.existing_vpc_id != null && length(var.existing_private_subnet_ids) >= 2)
      error_message = "With create_vpc = false, set existing_vpc_id and at least two existing_private_subnet_ids."
    }
  }
}

module "vpc" {
  #checkov:skip=CKV_TF_1: registry module pinned to an exact version; registry sources cannot take a commit hash
  source  = "terraform-aws-modules/vpc/aws"
  version = "5.21.0"
  count   = var.create_vpc ? 1 : 0

  name = var.cluster_name
  cidr = var.vpc_cidr
  azs  = local.azs

  private_subnets = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnets  = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 8, 48 + i)]

  enable_nat_gateway = true
  single_nat_gateway = true

  public_subnet_tags  = { "kubernetes.io/role/elb" = 1 }
  private_subnet_tags = { "kubernetes.io/role/internal-elb" = 1 }

  tags = var.tags
}

module "eks" {
  #checkov:skip=CKV_TF_1: registry module pinned to an exact version; registry sources cannot take a commit hash
  source  = "terraform-aws-modules/eks/aws"
  version = "20.37.2"

  cluster_name    = var.cluster_name
  cluster_version = var.kubernetes_version

  cluster_endpoint_public_access           = true
  cluster_endpoint_public_access_cidrs     = var.cluster_endpoint_public_access_cidrs
  enable_cluster_creator_admin_permissions = true

  cluster_addons = {
    coredns                = {}
    kube-proxy             = {}
    vpc-cni                = {}
    eks-pod-identity-agent = {}
  }

  vpc_id     = local.vpc_id
  subnet_ids = local.private_subnet_ids

  eks_managed_node_groups = {
    system = {
      ami_type       = "AL2023_x86_64_STANDARD"
      instance_types = [var.system_instance_type]
      min_size       = var.system_node_min_size
      max_size       = var.system_node_max_size
      desired_size   = var.system_node_min_size
      labels         = { "shardserve.io/role" = "system" }
    }

    # The EKS managed node group's desired size is ignored after creation: the cluster
    # autoscaler owns it between min_size and max_size.
    gpu = {
      ami_type       = "AL2023_x86_64_NVIDIA"
      instance_types = [local.gpu_instance_type]
      capacity_type  = var.gpu_capacity_type
      min_size       = var.gpu_node_min_size
      max_size       = var.gpu_node_max_size
      desired_size   = var.gpu_node_min_size

      labels = {
        "shardserve.io/role"     = "gpu"
        "nvidia.com/gpu.present" = "true" # the NVIDIA device plugin chart's node affinity
      }

      taints = {
        gpu = {
          key    = "nvidia.com/gpu"
          value  = "true"
          effect = "NO_SCHEDULE"
        }
      }

      block_device_mappings = {
        xvda = {
          device_name = "/dev/xvda"
          ebs = {
            volume_size           = var.gpu_node_disk_gb
            volume_type           = "gp3"
            encrypted             = true
            delete_on_termination = true
          }
        }
      }
    }
  }

  tags = var.tags
}
