"""`deepspeed.monitor`: the monitors a script writes its own series to, outside the engine
(`MonitorMaster(get_monitor_config(config)).write_events([(tag, value, step)])`), over
shardwise's monitors (frontends/deepspeed/monitors/). Imported when named, as in DeepSpeed."""
