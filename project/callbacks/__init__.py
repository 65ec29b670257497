from project.callbacks.prediction_writer import PredictionCsvWriter
from project.callbacks.throughput import ThroughputLogger

__all__ = ["PredictionCsvWriter", "ThroughputLogger"]
