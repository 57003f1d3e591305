"""Inference: the sufficient-statistic ELBO and its KL estimators, VOGN."""

__all__: list[str] = []
