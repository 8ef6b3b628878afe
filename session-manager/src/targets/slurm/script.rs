//! The sbatch script of a job: `#SBATCH` options from the spec, then a bash body that runs
//! `apptainer exec --nv <sif> <command>` in the background, forwards SIGUSR1 to it (Slurm
//! sends the halt signal to the batch shell only: `--signal=B:USR1@<lead>` and `scancel
//! --batch --signal=USR1`), and exits with the command's exit code (so 85 is Slurm's
//! `RequeueExit` and 123 a clean halt). A run after Slurm re-queued the job is the next job of
//! the chain in ongrid, and its `ONGRID_JOB_ID` is that job's id, derived by the script as the
//! manager derives it ([`crate::domain::engine_job::requeued_job_id`]).
//!
//! Every value that reaches the shell is single-quoted; nothing of the spec is ever evaluated.

use std::fmt::Write as _;

use ongrid_core::job::{ENV_JOB_ID, ENV_RESTART_COUNT, ENV_RESTART_INITIAL_JOB_ID};
use ongrid_core::{ComputeCapability, GpuRequest, MemorySize};

use super::super::{engine_job_name, SlurmConfig, TargetJob};
use crate::domain::engine_job::REQUEUED_JOB_ID_BASH;

/// A GPU type of the cluster as its `gres.conf` names it (`Type=a100`), with what it offers, so
/// a request's minimum capability and memory become a typed `--gres`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuType {
    pub name: String,
    pub capability: ComputeCapability,
    pub memory: MemorySize,
    /// The node feature of the nodes with this type (`Features=` in slurm.conf), for a
    /// `--constraint` when several types fit; `None`: the type's name.
    pub feature: Option<String>,
}

/// Why a job cannot become a script.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScriptError(pub String);

/// Quotes `text` for bash: `'...'` with `'` written `'\''`.
pub fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// `--gres` (and a `--constraint` when several typed GPUs fit) for `request`.
fn gres(request: &GpuRequest, types: &[GpuType]) -> Result<Vec<String>, ScriptError> {
    let n = request.count;
    let pinned = request.min_capability.is_some() || request.min_memory.is_some();
    if !pinned {
        return Ok(vec![format!("--gres=gpu:{n}")]);
    }
    if types.is_empty() {
        // A plain --gres would run the job on whatever GPU is free: the requirement dropped.
        return Err(ScriptError(format!(
            "this Slurm target cannot ask for {}: the site has not told ongrid its cluster's GPU \
             types (gpu_types in [targets.slurm]); submit without --min-capability and \
             --min-gpu-memory, run it here with --to local, or ask the site to map its GPU types",
            ongrid_core::job::describe_need(request)
        )));
    }
    let fits: Vec<&GpuType> = types
        .iter()
        .filter(|t| {
            request.min_capability.is_none_or(|c| t.capability >= c)
                && request.min_memory.is_none_or(|m| t.memory >= m)
        })
        .collect();
    match fits.as_slice() {
        [] => {
            let offered: Vec<String> = types
                .iter()
                .map(|t| format!("{} ({}, {})", t.name, t.capability, t.memory))
                .collect();
            Err(ScriptError(format!(
                "no GPU of the Slurm cluster meets {}: it has {}",
                ongrid_core::job::describe_need(request),
                offered.join(", ")
            )))
        }
        [only] => Ok(vec![format!("--gres=gpu:{}:{n}", only.name)]),
        several if several.len() == types.len() => Ok(vec![format!("--gres=gpu:{n}")]),
        several => {
            let features: Vec<&str> = several
                .iter()
                .map(|t| t.feature.as_deref().unwrap_or(&t.name))
                .collect();
            Ok(vec![
                format!("--gres=gpu:{n}"),
                format!("--constraint={}", features.join("|")),
            ])
        }
    }
}

/// Slurm's `D-HH:MM:SS`, rounded up to whole minutes (Slurm's time limits are minutes).
pub fn slurm_time(seconds: u64) -> String {
    let minutes = seconds.div_ceil(60).max(1);
    let (days, rest) = (minutes / (24 * 60), minutes % (24 * 60));
    format!("{days}-{:02}:{:02}:00", rest / 60, rest % 60)
}

/// The `#SBATCH` options of `job`, in order.
pub fn options(job: &TargetJob, config: &SlurmConfig) -> Result<Vec<String>, ScriptError> {
    let spec = &job.spec;
    let name = engine_job_name(job.id);
    let mut options = vec![
        format!("--job-name={name}"),
        // What Slurm itself writes (a failure before the script runs); the job's own output
        // goes to a file per run, see `body`.
        format!("--output={}/slurm-%j.log", config.output_dir.display()),
        format!("--chdir={}", config.output_dir.display()),
        "--export=NONE".to_owned(),
    ];
    options.extend(gres(&spec.gpus, &config.gpu_types)?);
    if let Some(max) = job.max_duration {
        options.push(format!(
            "--time={}",
            slurm_time(max.as_duration().as_secs())
        ));
    }
    if let Some(min) = spec.min_duration {
        options.push(format!(
            "--time-min={}",
            slurm_time(min.as_duration().as_secs())
        ));
    }
    options.push(format!(
        "--signal=B:USR1@{}",
        config.halt_lead.as_secs().clamp(1, 65_535)
    ));
    // A checkpoint exit (85) is re-queued by Slurm's RequeueExit whatever the job says; a
    // restartable job is also re-queued when its node fails or it is preempted.
    options.push(if spec.restartable {
        "--requeue".to_owned()
    } else {
        "--no-requeue".to_owned()
    });
    if let Some(cpus) = spec.cpus {
        options.push(format!("--cpus-per-task={}", cpus.millis().div_ceil(1000)));
    }
    if let Some(memory) = spec.memory {
        options.push(format!("--mem={}M", memory.bytes().div_ceil(1024 * 1024)));
    }
    if let Some(partition) = &config.partition {
        options.push(format!("--partition={partition}"));
    }
    if let Some(not_before) = spec.not_before {
        options.push(format!(
            "--begin={}",
            not_before.format("%Y-%m-%dT%H:%M:%S")
        ));
    }
    if let Some(not_after) = spec.not_after {
        options.push(format!(
            "--deadline={}",
            not_after.format("%Y-%m-%dT%H:%M:%S")
        ));
    }
    options.extend(config.extra_options.iter().cloned());
    Ok(options)
}

/// The whole script of `job`.
pub fn script(job: &TargetJob, config: &SlurmConfig) -> Result<String, ScriptError> {
    let mut text = String::from("#!/bin/bash\n");
    let _ = writeln!(
        text,
        "# ongrid job {} ({} of its chain), written by ongrid-manager.",
        job.id, job.chain.restart_count
    );
    for option in options(job, config)? {
        if option.contains('\n') {
            return Err(ScriptError(format!("option {option:?} spans lines")));
        }
        let _ = writeln!(text, "#SBATCH {option}");
    }
    text.push_str(&body(job, config));
    Ok(text)
}

fn body(job: &TargetJob, config: &SlurmConfig) -> String {
    // The halt signal (Slurm's --signal=B:USR1 before the time limit, or a halt by its owner)
    // reaches this shell only, which passes it on to the command. Trapped first: untrapped, a
    // USR1 ends this shell (bash's default for it). One that comes before the command runs is
    // noted: before it starts, the job ends as halted without it; while it starts, it is passed
    // on once the command runs.
    let mut text = String::from(
        "ongrid_child=\n\
         ongrid_halt=\n\
         trap 'if [ -n \"$ongrid_child\" ]; then kill -USR1 \"$ongrid_child\" 2>/dev/null; \
         else ongrid_halt=1; fi' USR1\n",
    );
    let output = format!(
        "{}/slurm-${{SLURM_JOB_ID}}-${{SLURM_RESTART_COUNT:-0}}.out",
        config.output_dir.display()
    );
    // The job's output, a file per run (Slurm re-runs a re-queued job under the same id).
    let _ = writeln!(text, "exec >>\"{output}\" 2>&1");
    let _ = writeln!(text, "export PATH={}", quote(&config.job_path));
    for (name, value) in job.spec.env.iter() {
        let _ = writeln!(text, "export {name}={}", quote(value));
    }
    // Slurm re-runs a re-queued job (RequeueExit) under the same script; ongrid lists each run
    // as the next job of the chain, whose id the script derives as the manager does.
    text.push_str(REQUEUED_JOB_ID_BASH);
    let _ = writeln!(text, "ongrid_id={}", quote(&job.id.to_string()));
    text.push_str(
        "for (( ongrid_run = 0; ongrid_run < ${SLURM_RESTART_COUNT:-0}; ongrid_run++ )); do\n\
         \x20 ongrid_id=$(ongrid_requeued_id \"$ongrid_id\") || { echo \"ongrid: cannot derive \
         this run's ONGRID_JOB_ID: put sha256sum (coreutils) on job_path\" >&2; exit 1; }\n\
         done\n",
    );
    let _ = writeln!(text, "export {ENV_JOB_ID}=\"$ongrid_id\"");
    let _ = writeln!(
        text,
        "export {ENV_RESTART_COUNT}=$(( {} + ${{SLURM_RESTART_COUNT:-0}} ))",
        job.chain.restart_count
    );
    let _ = writeln!(
        text,
        "export {ENV_RESTART_INITIAL_JOB_ID}={}",
        quote(&job.chain.initial_job.to_string())
    );
    let mut command = vec![
        quote(&config.apptainer),
        "exec".to_owned(),
        "--nv".to_owned(),
        quote(&job.sif.display().to_string()),
    ];
    command.extend(job.spec.command.argv().iter().map(|arg| quote(arg)));
    text.push_str(
        "if [ -n \"$ongrid_halt\" ]; then\n\
         \x20 echo \"ongrid: halted before its command started; it did not run\"\n\
         \x20 exit 123\n\
         fi\n",
    );
    let _ = writeln!(text, "{} &", command.join(" "));
    text.push_str(
        "ongrid_started=$!\n\
         # Until the exec, the command's process is a copy of this shell, whose copied trap would\n\
         # take the signal for itself and forget it: known to the trap once it runs something\n\
         # else (at most a second later); a halt meanwhile is noted and passed on then.\n\
         for (( ongrid_try = 0; ongrid_try < 100; ongrid_try++ )); do\n\
         \x20 [[ /proc/$ongrid_started/exe -ef /proc/$$/exe ]] || break\n\
         \x20 sleep 0.01\n\
         done\n\
         ongrid_child=$ongrid_started\n\
         if [ -n \"$ongrid_halt\" ]; then kill -USR1 \"$ongrid_child\" 2>/dev/null; fi\n\
         # A job's POSIXLY_CORRECT put bash in POSIX mode, where a wait forgets the exit code it\n\
         # gave (the last wait below would answer 127); the command has its environment already.\n\
         set +o posix\n\
         # A trapped signal ends a wait early, with 128 + its number; the command may end while\n\
         # the trap runs. The last wait gives its own exit code, which the shell keeps.\n\
         while kill -0 \"$ongrid_child\" 2>/dev/null; do\n\
         \x20 wait \"$ongrid_child\"\n\
         done\n\
         wait \"$ongrid_child\"\n\
         exit $?\n",
    );
    text
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use ongrid_core::job::{JobId, JobSpecFile, RestartChain};
    use ongrid_core::HumanDuration;

    use super::*;
    use crate::domain::grid_jobs::LocalAccount;
    use crate::targets::RunAs;

    fn config() -> SlurmConfig {
        SlurmConfig {
            sbatch: "sbatch".into(),
            squeue: "squeue".into(),
            sacct: "sacct".into(),
            scancel: "scancel".into(),
            slurm_conf: None,
            image_dir: "/images".into(),
            output_dir: "/scratch/ongrid".into(),
            partition: Some("gpu".into()),
            apptainer: "apptainer".into(),
            job_path: "/usr/bin:/bin".into(),
            halt_lead: Duration::from_secs(120),
            completion_log: true,
            run_as: RunAs::default(),
            extra_options: vec!["--qos=grid".into()],
            gpu_types: vec![
                GpuType {
                    name: "a100".into(),
                    capability: ComputeCapability::new(8, 0),
                    memory: MemorySize::parse("40G").unwrap(),
                    feature: None,
                },
                GpuType {
                    name: "h100".into(),
                    capability: ComputeCapability::new(9, 0),
                    memory: MemorySize::parse("80G").unwrap(),
                    feature: Some("hopper".into()),
                },
            ],
        }
    }

    fn job(file: JobSpecFile) -> TargetJob {
        let id = JobId(uuid::Uuid::from_u128(7));
        let spec = JobSpecFile {
            image: Some("model:v1".into()),
            command: vec!["python".into(), "train.py".into(), "it's".into()],
            ..file
        }
        .validate(chrono::Utc::now())
        .unwrap();
        TargetJob {
            id,
            max_duration: spec.max_duration,
            spec,
            sif: PathBuf::from("/images/sha256/abc.sif"),
            account: LocalAccount::parse("alice").unwrap(),
            chain: RestartChain::first(id),
        }
    }

    #[test]
    fn options_carry_gpus_durations_halt_lead_and_restartability() {
        let job = job(JobSpecFile {
            gpus: Some(2),
            min_capability: Some("9.0".into()),
            max_duration: Some("8h".into()),
            min_duration: Some("90 minutes".into()),
            restartable: true,
            cpus: Some(ongrid_core::job::CpuNumber::Fraction(1.5)),
            memory: Some("16GiB".into()),
            ..JobSpecFile::default()
        });
        let options = options(&job, &config()).unwrap();
        for expected in [
            "--job-name=ongrid-00000000-0000-0000-0000-000000000007",
            "--gres=gpu:h100:2",
            "--time=0-08:00:00",
            "--time-min=0-01:30:00",
            "--signal=B:USR1@120",
            "--requeue",
            "--cpus-per-task=2",
            "--mem=16384M",
            "--partition=gpu",
            "--qos=grid",
        ] {
            assert!(
                options.iter().any(|o| o == expected),
                "{expected} in {options:?}"
            );
        }
    }

    #[test]
    fn gres_is_typed_only_when_the_request_pins_a_class() {
        let types = config().gpu_types;
        let request = |cap: Option<&str>, mem: Option<&str>| GpuRequest {
            count: 1,
            min_capability: cap.map(|c| ComputeCapability::parse(c).unwrap()),
            min_memory: mem.map(|m| MemorySize::parse(m).unwrap()),
            ..GpuRequest::default()
        };
        assert_eq!(
            gres(&request(None, None), &types).unwrap(),
            ["--gres=gpu:1"]
        );
        assert_eq!(
            gres(&request(Some("8.0"), None), &types).unwrap(),
            ["--gres=gpu:1"]
        );
        assert_eq!(
            gres(&request(None, Some("80G")), &types).unwrap(),
            ["--gres=gpu:h100:1"]
        );
        let three = vec![
            types[0].clone(),
            types[1].clone(),
            GpuType {
                name: "v100".into(),
                capability: ComputeCapability::new(7, 0),
                memory: MemorySize::parse("32G").unwrap(),
                feature: None,
            },
        ];
        assert_eq!(
            gres(&request(Some("8.0"), None), &three).unwrap(),
            ["--gres=gpu:1", "--constraint=a100|hopper"]
        );
        let refused = gres(&request(Some("10.0"), None), &types).unwrap_err();
        assert!(refused.0.contains("a100 (8.0, 40 GiB)") || refused.0.contains("a100 (8.0"));
        // Without the site's GPU types a requirement cannot be expressed: refused, not dropped.
        let refused = gres(&request(Some("10.0"), Some("200G")), &[]).unwrap_err();
        assert!(refused.0.contains("gpu_types"), "{}", refused.0);
        assert_eq!(gres(&request(None, None), &[]).unwrap(), ["--gres=gpu:1"]);
    }

    #[test]
    fn the_body_runs_the_sif_with_apptainer_and_quotes_everything() {
        let mut job = job(JobSpecFile {
            env: [("GREETING".to_owned(), "it's $HOME".to_owned())].into(),
            ..JobSpecFile::default()
        });
        job.max_duration = Some(HumanDuration::from_secs(61));
        let text = script(&job, &config()).unwrap();
        assert!(text.starts_with("#!/bin/bash\n"));
        assert!(text.contains("#SBATCH --time=0-00:02:00\n"), "{text}");
        assert!(text.contains("#SBATCH --no-requeue\n"));
        assert!(text.contains(
            "'apptainer' exec --nv '/images/sha256/abc.sif' 'python' 'train.py' 'it'\\''s' &\n"
        ));
        assert!(text.contains("export GREETING='it'\\''s $HOME'\n"));
        assert!(text.contains("export ONGRID_RESTART_COUNT=$(( 0 + ${SLURM_RESTART_COUNT:-0} ))"));
        assert!(text.contains("ongrid_id='00000000-0000-0000-0000-000000000007'\n"));
        assert!(text.contains("export ONGRID_JOB_ID=\"$ongrid_id\"\n"));
        // The halt trap comes before anything else runs.
        let body = &text[text.rfind("#SBATCH").unwrap()..];
        let body = &body[body.find('\n').unwrap() + 1..];
        assert!(
            body.starts_with(
                "ongrid_child=\nongrid_halt=\ntrap 'if [ -n \"$ongrid_child\" ]; then kill -USR1 \
                 \"$ongrid_child\" 2>/dev/null; else ongrid_halt=1; fi' USR1\nexec >>"
            ),
            "{body}"
        );
        assert!(text.ends_with("wait \"$ongrid_child\"\nexit $?\n"));
    }

    /// When the test sends the halt signal to the script's shell.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Halt {
        Never,
        /// Once the command has printed `waiting`.
        OnceWaiting,
        /// The shell sends it to itself just before it runs this command of the script (a
        /// `DEBUG` trap from `BASH_ENV`).
        Before(&'static str),
    }

    /// The script run by bash as Slurm would, with an apptainer stand-in that runs the command;
    /// `slow_kill` makes the halt trap's `kill` take half a second, so the command ends while
    /// the trap runs. The script's exit status and output.
    fn run_script(
        command: &str,
        env: &[(&str, &str)],
        halt: Halt,
        slow_kill: bool,
    ) -> (Option<i32>, String) {
        let dir = tempfile::tempdir().unwrap();
        let stand_in = dir.path().join("apptainer");
        std::fs::write(
            &stand_in,
            "#!/bin/sh\n[ \"$1\" = exec ] || exit 99\nshift 3\nexec \"$@\"\n",
        )
        .unwrap();
        std::fs::set_permissions(
            &stand_in,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let mut job = job(JobSpecFile {
            env: env
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect(),
            ..JobSpecFile::default()
        });
        job.spec.command =
            ongrid_core::job::Command::new(vec!["sh".into(), "-c".into(), command.into()]).unwrap();
        let config = SlurmConfig {
            apptainer: stand_in.display().to_string(),
            output_dir: dir.path().into(),
            ..config()
        };
        let path = dir.path().join("job.sh");
        std::fs::write(&path, script(&job, &config).unwrap()).unwrap();
        let mut bash = std::process::Command::new("bash");
        bash.arg(&path).env("SLURM_JOB_ID", "1");
        if slow_kill {
            bash.env(
                "BASH_FUNC_kill%%",
                "() { builtin kill \"$@\"; local sent=$?; sleep 0.5; return $sent; }",
            );
        }
        if let Halt::Before(command) = halt {
            let debug = dir.path().join("debug.bash");
            let action = format!(
                "[[ $BASH_COMMAND == {} ]] && builtin kill -USR1 $$",
                quote(command)
            );
            std::fs::write(&debug, format!("trap {} DEBUG\n", quote(&action))).unwrap();
            bash.env("BASH_ENV", &debug);
        }
        let mut child = bash.spawn().unwrap();
        let output = dir.path().join("slurm-1-0.out");
        let read = || std::fs::read_to_string(&output).unwrap_or_default();
        if halt == Halt::OnceWaiting {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !read().contains("waiting") {
                assert!(std::time::Instant::now() < deadline, "{}", read());
                std::thread::sleep(Duration::from_millis(10));
            }
            let sent = std::process::Command::new("kill")
                .args(["-USR1", &child.id().to_string()])
                .status()
                .unwrap();
            assert!(sent.success());
        }
        let status = child.wait().unwrap();
        (status.code(), read())
    }

    #[test]
    fn the_script_exits_with_the_commands_code_even_when_it_ends_during_the_halt_trap() {
        let halted = "trap 'echo got USR1; exit 123' USR1; echo waiting; \
                      while :; do sleep 0.05; done";
        for slow_kill in [false, true] {
            let (code, output) = run_script(halted, &[], Halt::OnceWaiting, slow_kill);
            assert_eq!(code, Some(123), "slow kill {slow_kill}: {output}");
            assert_eq!(output.matches("got USR1").count(), 1, "{output}");
        }
        // A halt that comes while the command starts reaches it once it runs: this one, without
        // a trap of its own, is ended by it (128 + 10). Lost, it would exit 3 after its sleep;
        // had the halt ended the shell, the script would have no exit code.
        let points = [
            "ongrid_started=$!",
            "[[ /proc/$ongrid_started/exe -ef /proc/$$/exe ]]",
            "ongrid_child=$ongrid_started",
        ];
        for point in points {
            for _ in 0..3 {
                let (code, output) = run_script("sleep 5; exit 3", &[], Halt::Before(point), false);
                assert_eq!(code, Some(138), "halted before {point}: {output}");
            }
        }
        // One that comes before it starts ends the job as halted, the command not run.
        let early = Halt::Before("export ONGRID_JOB_ID=\"$ongrid_id\"");
        let (code, output) = run_script("echo ran; exit 7", &[], early, false);
        assert_eq!(
            (code, output.as_str()),
            (
                Some(123),
                "ongrid: halted before its command started; it did not run\n"
            )
        );
        // The script's own names leave the job's environment alone.
        let (code, output) = run_script(
            "echo \"child $child\"; exit 7",
            &[("child", "theirs")],
            Halt::Never,
            false,
        );
        assert_eq!((code, output.as_str()), (Some(7), "child theirs\n"));
        assert_eq!(
            run_script("echo done; exit 7", &[], Halt::Never, false).0,
            Some(7)
        );
        // A job that asks for POSIX behaviour gets it; the script's own waits keep bash's.
        let posix = [("POSIXLY_CORRECT", "1")];
        let (code, output) = run_script(
            "echo \"posix $POSIXLY_CORRECT\"; exit 7",
            &posix,
            Halt::Never,
            false,
        );
        assert_eq!((code, output.as_str()), (Some(7), "posix 1\n"));
        // A command that ignores the halt signal runs on to its own end.
        let ignored = "trap '' USR1; echo waiting; sleep 1; exit 5";
        assert_eq!(run_script(ignored, &[], Halt::OnceWaiting, true).0, Some(5));
    }

    #[test]
    fn slurm_time_rounds_up_to_minutes() {
        assert_eq!(slurm_time(1), "0-00:01:00");
        assert_eq!(slurm_time(3600), "0-01:00:00");
        assert_eq!(slurm_time(2 * 86_400 + 61), "2-00:02:00");
    }
}
