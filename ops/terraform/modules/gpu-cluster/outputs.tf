output "cluster_name" {
  description = "EKS cluster name."
  value       = module.eks.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = module.eks.cluster_endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64 CA certificate of the Kubernetes API."
  value       = module.eks.cluster_certificate_authority_data
}

output "region" {
  description = "AWS region of the cluster."
  value       = data.aws_region.current.name
}

output "kubeconfig_command" {
  description = "Writes a kubeconfig entry for this cluster."
  value       = "aws eks update-kubeconfig --region ${data.aws_region.current.name} --name ${module.eks.cluster_name}"
}

output "gpu_instance_type" {
  description = "Instance type of the GPU node group (from gpu_instance_types[tensor_parallel_size])."
  value       = terraform_data.sizing_guards.output.gpu_instance_type
}

output "kuberay_operator_version" {
  description = "KubeRay operator chart version installed."
  value       = helm_release.kuberay_operator.version
}
