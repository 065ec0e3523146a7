variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-west-2"
}

variable "cluster_name" {
  description = "EKS cluster name."
  type        = string
  default     = "shardserve-tp2"
}

variable "image" {
  description = "shardserve image built from the repository's Dockerfile and pushed to your registry."
  type        = string
}

variable "model_path" {
  description = "Model directory inside the pods, under /models."
  type        = string
  default     = "/models/model"
}

variable "model_s3_uri" {
  description = "s3:// prefix holding the Hugging Face model directory (or use model_pvc_claim_name)."
  type        = string
  default     = null
}

variable "model_pvc_claim_name" {
  description = "PersistentVolumeClaim holding the model directory (or use model_s3_uri)."
  type        = string
  default     = null
}

variable "model_reader_role_arn" {
  description = "IAM role (IRSA, trusting the cluster's OIDC provider) that may read model_s3_uri."
  type        = string
  default     = null
}

variable "served_model_name" {
  description = "Model name clients send."
  type        = string
  default     = null
}

variable "max_model_len" {
  description = "Longest prompt + completion in tokens."
  type        = number
  default     = 4096
}

variable "max_num_seqs" {
  description = "Sequences batched per replica."
  type        = number
  default     = 64
}

variable "min_replicas" {
  description = "Fewest replicas (TP=2 GPU worker pods)."
  type        = number
  default     = 1
}

variable "max_replicas" {
  description = "Most replicas. gpu_node_max_size x 2 replicas per node must hold them."
  type        = number
  default     = 4
}

variable "target_queue_depth" {
  description = "Sequences per replica the autoscaling policy aims for."
  type        = number
  default     = 32
}

variable "gpu_node_min_size" {
  description = "Fewest GPU nodes."
  type        = number
  default     = 1
}

variable "gpu_node_max_size" {
  description = "Most GPU nodes (each holds two TP=2 replicas)."
  type        = number
  default     = 2
}

variable "gpu_capacity_type" {
  description = "ON_DEMAND or SPOT."
  type        = string
  default     = "ON_DEMAND"
}

variable "otlp_traces_endpoint" {
  description = "OTLP collector endpoint, e.g. http://otel-collector.observability:4318/v1/traces."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags for every AWS resource."
  type        = map(string)
  default     = {}
}
