"""python -m classifier_engine {fit,validate,test,predict,export,sweep} --model.class_path M --data.class_path D

The engine without a template: the model and data classes come from the config (`class_path`), nothing is default.
"""

from classifier_engine.entry import main

if __name__ == "__main__":
    main()
