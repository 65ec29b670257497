from project.engine.callbacks.prediction_writer import PredictionCsvWriter
from project.engine.callbacks.throughput import ThroughputLogger

__all__ = ["PredictionCsvWriter", "ThroughputLogger"]
