output "namespace" {
  description = "Namespace of the RayService."
  value       = kubernetes_namespace.this.metadata[0].name
}

output "endpoint" {
  description = "OpenAI-compatible base URL inside the cluster."
  value       = "http://${var.name}-serve.${var.namespace}.svc.cluster.local:8000/v1"
}

output "port_forward_command" {
  description = "Reaches the API from your machine at http://127.0.0.1:8000/v1."
  value       = "kubectl -n ${var.namespace} port-forward service/${var.name}-serve 8000:8000"
}

output "serve_config" {
  description = "The Ray Serve config (serveConfigV2) the RayService runs."
  value       = yamlencode(local.serve_config)
}
