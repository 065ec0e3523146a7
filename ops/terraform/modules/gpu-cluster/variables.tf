variable "cluster_name" {
  description = "Name of the EKS cluster (also prefixes the VPC and IAM roles)."
  type        = string
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.33"
}

# --- network: a new VPC, or an existing one -------------------------------------------------

variable "create_vpc" {
  description = "Create a VPC (true) or use existing_vpc_id / existing_private_subnet_ids (false)."
  type        = bool
  default     = true
}

variable "vpc_cidr" {
  description = "CIDR of the VPC created when create_vpc is true."
  type        = string
  default     = "10.0.0.0/16"
}

variable "existing_vpc_id" {
  description = "VPC to use when create_vpc is false."
  type        = string
  default     = null
}

variable "existing_private_subnet_ids" {
  description = "Private subnets (at least two availability zones) to use when create_vpc is false."
  type        = list(string)
  default     = []
}

variable "cluster_endpoint_public_access_cidrs" {
  description = "CIDRs allowed to reach the public Kubernetes API endpoint. Narrow this to your network."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

# --- GPU nodes: the instance type follows the tensor-parallel size --------------------------

variable "tensor_parallel_size" {
  description = "GPUs per shardserve replica (TP). Picks the GPU instance type from gpu_instance_types."
  type        = number
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8], var.tensor_parallel_size)
    error_message = "tensor_parallel_size must be 1, 2, 4 or 8."
  }
}

variable "gpu_instance_types" {
  description = <<-EOT
    GPU instance type per tensor-parallel size. A node must hold at least TP GPUs; a node with
    G GPUs hosts G / TP replicas. AWS has no 2-GPU g5/g6/g6e size, so TP=2 runs two replicas per
    4-GPU node.
      "1" = g6e.xlarge    1 x L40S 48 GB
      "2" = g6.12xlarge   4 x L4 24 GB   (2 replicas per node)
      "4" = g6e.12xlarge  4 x L40S 48 GB (1 replica per node)
      "8" = p4d.24xlarge  8 x A100 40 GB (1 replica per node)
  EOT
  type        = map(string)
  default = {
    "1" = "g6e.xlarge"
    "2" = "g6.12xlarge"
    "4" = "g6e.12xlarge"
    "8" = "p4d.24xlarge"
  }
}

variable "gpu_capacity_type" {
  description = "ON_DEMAND or SPOT for the GPU node group."
  type        = string
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "gpu_node_min_size" {
  description = "Fewest GPU nodes; the cluster autoscaler never goes below it (0 lets an idle fleet cost nothing)."
  type        = number
  default     = 0
}

variable "gpu_node_max_size" {
  description = "Most GPU nodes the cluster autoscaler may add. Must hold max_replicas x TP GPUs."
  type        = number
  default     = 2
}

variable "gpu_node_disk_gb" {
  description = "Root volume per GPU node: the image (~15 GB) plus any model copied to node-local disk."
  type        = number
  default     = 200
}

# --- system nodes: KubeRay operator, Ray head, cluster autoscaler, CoreDNS -------------------

variable "system_instance_type" {
  description = "Instance type of the CPU node group (Ray head, operators)."
  type        = string
  default     = "m6i.2xlarge"
}

variable "system_node_min_size" {
  description = "Fewest CPU system nodes."
  type        = number
  default     = 2
}

variable "system_node_max_size" {
  description = "Most CPU system nodes."
  type        = number
  default     = 4
}

variable "scale_down_unneeded_time" {
  description = "How long a node sits idle before the cluster autoscaler removes it."
  type        = string
  default     = "10m"
}

variable "tags" {
  description = "Tags for every AWS resource."
  type        = map(string)
  default     = {}
}
