output "endpoint" {
  description = "OpenAI-compatible base URL inside the cluster."
  value       = module.shardserve.endpoint
}

output "port_forward_command" {
  description = "Reaches the API from your machine at http://127.0.0.1:8000/v1."
  value       = module.shardserve.port_forward_command
}

output "kubeconfig_command" {
  description = "Writes a kubeconfig entry for the cluster."
  value       = module.gpu_cluster.kubeconfig_command
}

output "gpu_instance_type" {
  description = "GPU node instance type."
  value       = module.gpu_cluster.gpu_instance_type
}
