"""The source model, run one decoder layer at a time in flat memory: the samples it runs on
(`samples`), where each of its parameters comes from in the checkpoint (`weights`), the
activations kept between layers (`buffer`) and the walk itself with its pass seam (`layers`)."""
