"""DeepSpeed-style pipeline modules: ``from meshtrain.pipe import PipelineModule, LayerSpec``."""

from meshtrain.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
