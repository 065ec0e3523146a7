# shardserve as a KubeRay RayService. One Serve replica = one GPU worker pod with
# tensor_parallel_size GPUs: the replica's placement group ({"GPU": 1} x TP, STRICT_PACK) fits
# exactly in that pod, so the Ray autoscaler adds a pod per replica Serve asks for, and the
# cluster autoscaler adds a GPU node when that pod cannot be placed.
#
# The RayService CRD comes from the KubeRay operator (module gpu-cluster): kubernetes_manifest
# needs it at plan time, hence the two-step apply in docs/OPERATIONS.md.

locals {
  # ServeArgs (app/config.py) for the application; `python -m ops.check` validates it.
  serve_args = {
    model                    = var.model_path
    served_model_name        = var.served_model_name
    tensor_parallel_size     = var.tensor_parallel_size
    dtype                    = var.dtype
    device                   = "cuda"
    accelerator_resource     = "GPU"
    accelerator_per_rank     = 1
    placement_group_strategy = "STRICT_PACK"
    max_model_len            = var.max_model_len
    max_num_seqs             = var.max_num_seqs
    max_num_batched_tokens   = var.max_num_batched_tokens
    gpu_memory_utilization   = var.gpu_memory_utilization
    enable_prefix_caching    = var.enable_prefix_caching
    min_replicas             = var.min_replicas
    max_replicas             = var.max_replicas
    target_queue_depth       = var.target_queue_depth
    upscale_delay_s          = var.upscale_delay_s
    downscale_delay_s        = var.downscale_delay_s
    port                     = 8000
    otlp_traces_endpoint     = var.otlp_traces_endpoint
  }

  serve_config = {
    proxy_location = "EveryNode"
    http_options   = { host = "0.0.0.0", port = 8000 }
    applications = [{
      name         = "shardserve"
      route_prefix = "/"
      import_path  = "app.deployment:build_app"
      args         = local.serve_args
    }]
  }

  # Each worker's Ray metrics export: its replica's series and, where the ingress runs, the routing series
  # (as ray_shardserve_*: relabel them to shardserve:*, docs/OPERATIONS.md "Scraping several replicas")
  metrics_export_port = 8080
  prometheus_annotations = {
    "prometheus.io/scrape" = "true"
    "prometheus.io/port"   = tostring(local.metrics_export_port)
    "prometheus.io/path"   = "/metrics"
  }

  pod_env = [
    { name = "HF_HUB_OFFLINE", value = "1" },
    { name = "TRANSFORMERS_OFFLINE", value = "1" },
    { name = "OTEL_SERVICE_NAME", value = var.name },
  ]

  model_volumes = concat(
    var.model_pvc_claim_name == null ? [] : [
      { name = "models", persistentVolumeClaim = { claimName = var.model_pvc_claim_name, readOnly = true } },
    ],
    var.model_pvc_claim_name == null ? [{ name = "models", emptyDir = {} }] : [],
  )

  # Where a worker pod keeps the unpacked GGUF cache (engine/checkpoint/gguf_cache.py): a volume of the pod, so
  # that the prepare-node init container fills it and the replica finds it
  node_cache_dir = "/var/cache/shardserve"
  node_cache_env = [{ name = "SHARDSERVE_CACHE", value = local.node_cache_dir }]

  # The per-node step, before Ray starts in the pod: fetch the model (model_s3_uri), then `shardserve
  # prepare-node` (app/prepare_node.py) checks that it loads and unpacks a GGUF file into the pod's cache
  model_init_containers = concat(var.model_s3_uri == null ? [] : [{
    name         = "fetch-model"
    image        = var.model_sync_image
    command      = ["aws", "s3", "sync", "--only-show-errors", var.model_s3_uri, var.model_path]
    volumeMounts = [{ name = "models", mountPath = "/models" }]
    }], [{
    name    = "prepare-node"
    image   = var.image
    command = ["shardserve", "prepare-node", "--model", var.model_path, "--dtype", var.dtype, "--device", "cuda"]
    env     = concat(local.pod_env, local.node_cache_env)
    volumeMounts = [
      { name = "models", mountPath = "/models", readOnly = true },
      { name = "shardserve-cache", mountPath = local.node_cache_dir },
    ]
  }])
}

resource "kubernetes_namespace" "this" {
  metadata {
    name = var.namespace
  }
}

resource "kubernetes_service_account" "ray" {
  metadata {
    name        = "${var.name}-ray"
    namespace   = kubernetes_namespace.this.metadata[0].name
    annotations = var.model_reader_role_arn == null ? {} : { "eks.amazonaws.com/role-arn" = var.model_reader_role_arn }
  }
}

resource "kubernetes_manifest" "rayservice" {
  manifest = {
    apiVersion = "ray.io/v1"
    kind       = "RayService"
    metadata = {
      name      = var.name
      namespace = kubernetes_namespace.this.metadata[0].name
    }
    spec = {
      serveConfigV2 = yamlencode(local.serve_config)

      serveService = {
        metadata = { name = "${var.name}-serve", annotations = var.service_annotations }
        spec = {
          type  = var.service_type
          ports = [{ name = "serve", port = 8000, targetPort = 8000 }]
        }
      }

      rayClusterConfig = {
        enableInTreeAutoscaling = true
        autoscalerOptions = {
          upscalingMode      = "Default"
          idleTimeoutSeconds = var.worker_idle_timeout_s
        }

        headGroupSpec = {
          # num-cpus 0: the head runs the Serve controller and a proxy, never a replica.
          rayStartParams = { "num-cpus" = "0", "dashboard-host" = "0.0.0.0" }
          # No scrape annotations here: /metrics is per replica, and the head holds none (its
          # proxy would answer with an arbitrary replica's numbers).
          template = {
            spec = {
              serviceAccountName = kubernetes_service_account.ray.metadata[0].name
              nodeSelector       = { "shardserve.io/role" = "system" }
              containers = [{
                name  = "ray-head"
                image = var.image
                env   = local.pod_env
                ports = [
                  { name = "gcs", containerPort = 6379 },
                  { name = "dashboard", containerPort = 8265 },
                  { name = "client", containerPort = 10001 },
                  { name = "serve", containerPort = 8000 },
                ]
                resources = {
                  requests = { cpu = var.head_cpu, memory = var.head_memory }
                  limits   = { cpu = var.head_cpu, memory = var.head_memory }
                }
              }]
            }
          }
        }

        # Scraped on Ray's metrics export port, not :8000/metrics: with several replicas the ingress answers
        # HTTP, so :8000/metrics would be the ingress's routing series, from whichever node it runs on.
        workerGroupSpecs = [{
          groupName      = "gpu"
          replicas       = var.min_replicas
          minReplicas    = var.min_replicas
          maxReplicas    = var.max_replicas
          rayStartParams = { "metrics-export-port" = tostring(local.metrics_export_port) }
          template = {
            metadata = { annotations = local.prometheus_annotations }
            spec = {
              serviceAccountName = kubernetes_service_account.ray.metadata[0].name
              nodeSelector       = { "shardserve.io/role" = "gpu" }
              tolerations = [
                { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
              ]
              initContainers = local.model_init_containers
              volumes = concat(local.model_volumes, [
                { name = "dshm", emptyDir = { medium = "Memory" } },
                { name = "shardserve-cache", emptyDir = {} },
              ])
              containers = [{
                name  = "ray-worker"
                image = var.image
                env   = concat(local.pod_env, local.node_cache_env)
                ports = [
                  { name = "serve", containerPort = 8000 },
                  { name = "metrics", containerPort = local.metrics_export_port },
                ]
                resources = {
                  requests = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.tensor_parallel_size }
                  limits   = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.tensor_parallel_size }
                }
                volumeMounts = [
                  { name = "models", mountPath = "/models", readOnly = var.model_s3_uri == null },
                  { name = "dshm", mountPath = "/dev/shm" },
                  { name = "shardserve-cache", mountPath = local.node_cache_dir },
                ]
                readinessProbe = {
                  httpGet             = { path = "/health", port = 8000 }
                  initialDelaySeconds = 30
                  periodSeconds       = 10
                  failureThreshold    = 6
                }
              }]
            }
          }
        }]
      }
    }
  }

  lifecycle {
    precondition {
      condition     = (var.model_pvc_claim_name == null) != (var.model_s3_uri == null)
      error_message = "Set exactly one of model_pvc_claim_name and model_s3_uri."
    }
    precondition {
      condition     = var.min_replicas <= var.max_replicas
      error_message = "min_replicas must not exceed max_replicas."
    }
  }
}
