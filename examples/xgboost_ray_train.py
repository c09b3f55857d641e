"""An XGBoost training function as Ray Train's XGBoostTrainer takes it, run by the launcher as is.

    launcher run --workload examples/xgboost_ray_train.py:train_fn_per_worker \\
        --data table.csv --param label=y --param num_boost_round=100 --workers 2

Each worker reads its share of the "train" and "validation" datasets (the launcher makes them
from --data with Ray Data), trains inside XGBoost's communicator (Ray Train's XGBoost backend
opened it), and reports a checkpoint every ``checkpoint_every`` rounds through
``RayTrainReportCallback``; a relaunch with the same --name goes on from the last one.
"""

import ray.train
import xgboost
from ray.train.xgboost import RayTrainReportCallback


def train_fn_per_worker(config: dict):
    label = config.get("label", "label")
    rounds = int(config.get("num_boost_round", 50))
    train_df = ray.train.get_dataset_shard("train").materialize().to_pandas()
    eval_df = ray.train.get_dataset_shard("validation").materialize().to_pandas()
    dtrain = xgboost.DMatrix(train_df.drop(columns=[label]), label=train_df[label])
    deval = xgboost.DMatrix(eval_df.drop(columns=[label]), label=eval_df[label])
    params = {"objective": config.get("objective", "reg:squarederror"), "tree_method": "hist",
              "max_depth": int(config.get("max_depth", 6)), "eta": float(config.get("eta", 0.3)),
              "eval_metric": config.get("eval_metric", "rmse"), "seed": int(config.get("seed", 0))}

    # Resume: the booster of the last reported checkpoint, and the rounds it already has.
    starting_model = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        starting_model = RayTrainReportCallback.get_model(checkpoint)
    done = starting_model.num_boosted_rounds() if starting_model is not None else 0

    xgboost.train(params, dtrain, num_boost_round=max(0, rounds - done), xgb_model=starting_model,
                  evals=[(dtrain, "train"), (deval, "validation")], verbose_eval=False,
                  callbacks=[RayTrainReportCallback(frequency=int(config.get("checkpoint_every", 10)))])
