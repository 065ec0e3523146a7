variable "name" {
  description = "Name of the RayService (and prefix of its Kubernetes services)."
  type        = string
  default     = "shardserve"
}

variable "namespace" {
  description = "Namespace created for the RayService."
  type        = string
  default     = "shardserve"
}

variable "image" {
  description = "shardserve container image (built from the repository's Dockerfile), pinned by tag or digest."
  type        = string
}

variable "model_reader_role_arn" {
  description = "IAM role (IRSA) allowed to read model_s3_uri; annotates the Ray pods' service account. null = none."
  type        = string
  default     = null
}

# --- the model: a local Hugging Face directory, never downloaded from a hub at run time ------

variable "model_path" {
  description = "Model directory inside the pods, under /models (ServeArgs.model)."
  type        = string
  default     = "/models/model"

  validation {
    condition     = startswith(var.model_path, "/models/")
    error_message = "model_path must be under /models/, where the model volume is mounted."
  }
}

variable "model_pvc_claim_name" {
  description = "PersistentVolumeClaim holding the model directory (mounted read-only at /models). Set this or model_s3_uri."
  type        = string
  default     = null
}

variable "model_s3_uri" {
  description = "s3://bucket/prefix copied into model_path by an init container before Ray starts. Set this or model_pvc_claim_name."
  type        = string
  default     = null
}

variable "model_sync_image" {
  description = "Image of the init container that copies model_s3_uri."
  type        = string
  default     = "public.ecr.aws/aws-cli/aws-cli:2.27.49"
}

variable "served_model_name" {
  description = "Model name clients send in requests (ServeArgs.served_model_name). null = the directory name."
  type        = string
  default     = null
}

# --- engine (ServeArgs fields of the same names) ---------------------------------------------

variable "tensor_parallel_size" {
  description = "GPUs per replica. Each GPU worker pod requests this many nvidia.com/gpu and hosts one replica."
  type        = number
  default     = 1
}

variable "dtype" {
  description = "Weight and activation dtype (ServeArgs.dtype)."
  type        = string
  default     = "bfloat16"
}

variable "max_model_len" {
  description = "Longest prompt + completion in tokens (ServeArgs.max_model_len). null = the model's own limit."
  type        = number
  default     = 4096
}

variable "max_num_seqs" {
  description = "Sequences batched together per replica (ServeArgs.max_num_seqs)."
  type        = number
  default     = 64
}

variable "max_num_batched_tokens" {
  description = "Token budget of one engine step (ServeArgs.max_num_batched_tokens)."
  type        = number
  default     = 8192
}

variable "gpu_memory_utilization" {
  description = "Fraction of each GPU's memory for weights plus KV cache (ServeArgs.gpu_memory_utilization)."
  type        = number
  default     = 0.9
}

variable "enable_prefix_caching" {
  description = "Reuse KV blocks of shared prompt prefixes (ServeArgs.enable_prefix_caching)."
  type        = bool
  default     = true
}

# --- autoscaling: Serve replicas = GPU worker pods --------------------------------------------

variable "min_replicas" {
  description = "Fewest Serve replicas, and so fewest GPU worker pods (ServeArgs.min_replicas)."
  type        = number
  default     = 1
}

variable "max_replicas" {
  description = "Most Serve replicas, and so most GPU worker pods (ServeArgs.max_replicas)."
  type        = number
  default     = 2
}

variable "target_queue_depth" {
  description = "Waiting + running sequences per replica the Serve policy aims for (ServeArgs.target_queue_depth)."
  type        = number
  default     = 32
}

variable "upscale_delay_s" {
  description = "Seconds the queue must stay above target before Serve adds a replica."
  type        = number
  default     = 30
}

variable "downscale_delay_s" {
  description = "Seconds the queue must stay below target before Serve removes a replica."
  type        = number
  default     = 600
}

variable "worker_idle_timeout_s" {
  description = "Seconds an idle Ray worker pod lives before the Ray autoscaler deletes it."
  type        = number
  default     = 300
}

# --- pods --------------------------------------------------------------------------------------

variable "worker_cpu" {
  description = "CPU of one GPU worker pod (at least tensor_parallel_size; G/TP pods must fit one node)."
  type        = string
  default     = "3"
}

variable "worker_memory" {
  description = "Memory of one GPU worker pod (weights are staged through host memory while loading)."
  type        = string
  default     = "24Gi"
}

variable "head_cpu" {
  description = "CPU of the Ray head pod (Serve controller and proxy; no replicas run there)."
  type        = string
  default     = "2"
}

variable "head_memory" {
  description = "Memory of the Ray head pod."
  type        = string
  default     = "8Gi"
}

variable "service_type" {
  description = "Type of the Service in front of port 8000: ClusterIP (port-forward or your ingress) or LoadBalancer."
  type        = string
  default     = "ClusterIP"

  validation {
    condition     = contains(["ClusterIP", "LoadBalancer"], var.service_type)
    error_message = "service_type must be ClusterIP or LoadBalancer."
  }
}

variable "service_annotations" {
  description = "Annotations of the Service on port 8000 (e.g. for an internal AWS load balancer)."
  type        = map(string)
  default     = {}
}

# --- observability -----------------------------------------------------------------------------

variable "otlp_traces_endpoint" {
  description = "OTLP collector endpoint for request traces (ServeArgs.otlp_traces_endpoint). null = no tracing."
  type        = string
  default     = null
}
