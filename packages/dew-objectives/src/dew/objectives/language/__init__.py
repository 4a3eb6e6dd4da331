"""Language modelling (``lm``) and distillation from a teacher (``distillation``,
``classifier_distillation``, ``teacher_topk``)."""
