# shardserve at tensor-parallel size 4 on g6e.12xlarge nodes (4 x L40S 48 GB): one replica per node.
# Apply in two steps (the RayService CRD must exist before its manifest is planned):
#   terraform apply -target=module.gpu_cluster
#   terraform apply

locals {
  tensor_parallel_size = 4
}

module "gpu_cluster" {
  source = "../../modules/gpu-cluster"

  cluster_name         = var.cluster_name
  tensor_parallel_size = local.tensor_parallel_size
  gpu_node_min_size    = var.gpu_node_min_size
  gpu_node_max_size    = var.gpu_node_max_size
  gpu_capacity_type    = var.gpu_capacity_type
  tags                 = var.tags
}

module "shardserve" {
  source = "../../modules/shardserve"

  image                 = var.image
  model_path            = var.model_path
  model_s3_uri          = var.model_s3_uri
  model_pvc_claim_name  = var.model_pvc_claim_name
  model_reader_role_arn = var.model_reader_role_arn
  served_model_name     = var.served_model_name

  tensor_parallel_size = local.tensor_parallel_size
  max_model_len        = var.max_model_len
  max_num_seqs         = var.max_num_seqs
  min_replicas         = var.min_replicas
  max_replicas         = var.max_replicas
  target_queue_depth   = var.target_queue_depth
  otlp_traces_endpoint = var.otlp_traces_endpoint

  # g6e.12xlarge: 48 vCPU, 384 GiB. One TP=4 worker pod per node, with room for daemonsets.
  worker_cpu    = "44"
  worker_memory = "340Gi"

  depends_on = [module.gpu_cluster]
}
