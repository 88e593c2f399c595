"""`jaxserve router`: one OpenAI endpoint in front of several servers (plain replicas, or prefill and decode
servers), with prefix-affine load balancing, health checks and retries. Imports no jax."""
