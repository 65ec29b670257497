from classifier_engine.callbacks.prediction_writer import PredictionCsvWriter
from classifier_engine.callbacks.throughput import ThroughputLogger

__all__ = ["PredictionCsvWriter", "ThroughputLogger"]
