# Cluster add-ons, each a Helm release with a pinned chart version:
#   NVIDIA device plugin  - advertises nvidia.com/gpu on GPU nodes
#   KubeRay operator      - runs RayService / RayCluster, including the Ray autoscaler sidecar
#   cluster autoscaler    - adds GPU nodes when Ray worker pods are pending, removes idle ones

resource "helm_release" "nvidia_device_plugin" {
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = "0.17.1"
  namespace        = "nvidia-device-plugin"
  create_namespace = true

  values = [yamlencode({
    # The chart's default affinity selects nodes labelled nvidia.com/gpu.present=true (set on
    # the GPU node group); the toleration lets the daemonset onto the tainted GPU nodes.
    tolerations = [
      { key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" },
      { key = "CriticalAddonsOnly", operator = "Exists" },
    ]
  })]

  depends_on = [module.eks]
}

resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = "1.4.2"
  namespace        = "kuberay-operator"
  create_namespace = true

  values = [yamlencode({
    nodeSelector = { "shardserve.io/role" = "system" }
  })]

  depends_on = [module.eks]
}

module "cluster_autoscaler_irsa" {
  #checkov:skip=CKV_TF_1: registry module pinned to an exact version; registry sources cannot take a commit hash
  source  = "terraform-aws-modules/iam/aws//modules/iam-role-for-service-accounts-eks"
  version = "5.60.0"

  role_name                        = "${var.cluster_name}-cluster-autoscaler"
  attach_cluster_autoscaler_policy = true
  cluster_autoscaler_cluster_names = [module.eks.cluster_name]

  oidc_providers = {
    main = {
      provider_arn               = module.eks.oidc_provider_arn
      namespace_service_accounts = ["kube-system:cluster-autoscaler"]
    }
  }

  tags = var.tags
}

resource "helm_release" "cluster_autoscaler" {
  name       = "cluster-autoscaler"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = "9.46.6"
  namespace  = "kube-system"

  values = [yamlencode({
    cloudProvider = "aws"
    awsRegion     = data.aws_region.current.name
    autoDiscovery = { clusterName = module.eks.cluster_name }
    rbac = {
      serviceAccount = {
        name        = "cluster-autoscaler"
        annotations = { "eks.amazonaws.com/role-arn" = module.cluster_autoscaler_irsa.iam_role_arn }
      }
    }
    nodeSelector = { "shardserve.io/role" = "system" }
    extraArgs = {
      # least-waste picks the node group that leaves the fewest GPUs idle after placing the pod.
      expander                      = "least-waste"
      balance-similar-node-groups   = true
      skip-nodes-with-local-storage = false
      scale-down-unneeded-time      = var.scale_down_unneeded_time
    }
  })]

  depends_on = [module.eks]
}
