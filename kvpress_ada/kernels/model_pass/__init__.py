"""What a scorer's model pass reads: dense attention with its log-sum-exp (``lse_attention``), the largest
attention each context entry receives (``pass_attention``)."""
