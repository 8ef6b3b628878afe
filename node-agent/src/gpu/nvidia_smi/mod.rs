//! The `nvidia-smi` GPU backend: real GPUs, discovered by running `nvidia-smi`.
//!
//! Discovery runs `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` and `nvidia-smi -L`
//! through an [`NvidiaSmiSource`], parses both ([`parse`]) and joins them. The source is the only
//! thing that differs between production ([`RealNvidiaSmi`], which runs the binary with a
//! timeout) and tests (recorded outputs): the interpretation of exit statuses, older drivers'
//! rejected fields and failures is the same code.
//!
//! Older drivers: when nvidia-smi says `Field "compute_cap" is not a valid field to query.`, the
//! backend drops that optional field for good, asks again, and derives the capability from the
//! model name ([`parse::capability_from_model`]). A GPU seen before that nvidia-smi no longer
//! lists is reported failed, so the manager drains it.
//!
//! Health: lines in which nvidia-smi says it cannot reach a GPU ("Unable to determine the device
//! handle for GPU 0000:3B:00.0", "GPU is lost") are taken out of its answers, and the GPU they
//! name (or, when they name none, every GPU missing from the answer) is reported failed with
//! that line. When nvidia-smi hangs (killed at the timeout) or fails otherwise, every GPU seen
//! before is reported `Unknown`, never healthy. A GPU with a fatal Xid in the kernel log
//! ([`super::health::KernelLog`], read where permitted) is reported failed.

pub mod parse;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use ongrid_core::{GpuHealth, GpuInfo};
use tracing::warn;

use self::parse::{parse_list, parse_query_gpu, query_argument, rejected_field, Field, ParseError};
use super::health::{take_problems, KernelLog, PciAddress, Problem};
use super::{GpuBackend, GpuError, SeenGpus};

/// How long one run of nvidia-smi may take. A hung nvidia-smi is a known failure mode (a stuck
/// driver, a GPU that fell off the bus); discovery must not hang with it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The health reason of a GPU that nvidia-smi listed before and does not list any more.
pub const GONE_REASON: &str = "not listed by nvidia-smi any more: fallen off the bus?";

/// Why the `nvidia-smi` backend could not discover the GPUs.
#[derive(Debug, thiserror::Error)]
pub enum NvidiaSmiError {
    #[error("nvidia-smi not found at {}: install the NVIDIA driver, set `path` in the agent's [gpu] table, or use backend = \"simulated\" on a machine without GPUs", path.display())]
    NotFound { path: PathBuf },
    #[error("timeout {value:?} in the agent's [gpu] table: {problem}; give a duration like \"10 seconds\"")]
    BadTimeout { value: String, problem: String },
    #[error("could not run {}: check that the agent's user may execute it", path.display())]
    Spawn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` did not finish within {} s and was killed: nvidia-smi hangs when the driver is stuck or a GPU fell off the bus; check `dmesg` for Xid errors, then reset the GPU or reboot the node", timeout.as_secs_f64())]
    TimedOut { command: String, timeout: Duration },
    #[error("`{command}` failed ({status}): {output}: {hint}")]
    Failed {
        command: String,
        status: String,
        /// What nvidia-smi printed (stderr, then stdout), trimmed.
        output: String,
        hint: &'static str,
    },
    #[error("could not understand the output of `{command}`")]
    Output {
        command: String,
        #[source]
        source: ParseError,
    },
}

/// What one run of nvidia-smi printed, and how it exited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmiOutput {
    /// The exit code; `None` when a signal ended the process.
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Where nvidia-smi's answers come from: the real binary, or recorded outputs in tests.
pub trait NvidiaSmiSource: Send + Sync + 'static {
    /// Runs `nvidia-smi <args>`. An exit status other than 0 is not an error here (the caller
    /// interprets it); not being able to run it, or it not finishing in time, is.
    fn run<'a>(&'a self, args: &'a [String]) -> BoxFuture<'a, Result<SmiOutput, NvidiaSmiError>>;
}

/// Runs the real nvidia-smi binary, killing it if it does not finish within the timeout.
#[derive(Debug, Clone)]
pub struct RealNvidiaSmi {
    path: PathBuf,
    timeout: Duration,
}

impl RealNvidiaSmi {
    /// `path` may be a bare `nvidia-smi`, found on `PATH`.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }
}

impl NvidiaSmiSource for RealNvidiaSmi {
    fn run<'a>(&'a self, args: &'a [String]) -> BoxFuture<'a, Result<SmiOutput, NvidiaSmiError>> {
        Box::pin(async move {
            let output = tokio::process::Command::new(&self.path)
                .args(args)
                .stdin(Stdio::null())
                // Dropping the future on timeout drops the child, which kills it.
                .kill_on_drop(true)
                .output();
            match tokio::time::timeout(self.timeout, output).await {
                Err(_elapsed) => Err(NvidiaSmiError::TimedOut {
                    command: command_line(args),
                    timeout: self.timeout,
                }),
                Ok(Err(error)) if error.kind() == std::io::ErrorKind::NotFound => {
                    Err(NvidiaSmiError::NotFound {
                        path: self.path.clone(),
                    })
                }
                Ok(Err(error)) => Err(NvidiaSmiError::Spawn {
                    path: self.path.clone(),
                    source: error,
                }),
                Ok(Ok(output)) => Ok(SmiOutput {
                    exit_code: output.status.code(),
                    stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
                }),
            }
        })
    }
}

/// The command as an operator would type it, for messages.
fn command_line(args: &[String]) -> String {
    format!("nvidia-smi {}", args.join(" "))
}

/// What to do about a failed nvidia-smi, from what it printed.
fn failure_hint(output: &str) -> &'static str {
    let output = output.to_ascii_lowercase();
    let says = |text: &str| output.contains(text);
    if says("couldn't communicate with the nvidia driver") || says("version mismatch") {
        "check that the NVIDIA driver is installed and loaded (`lsmod | grep nvidia`); after a driver upgrade, reboot the node"
    } else if says("unable to determine the device handle")
        || says("unknown error")
        || says("gpu is lost")
        || says("fallen off the bus")
    {
        "a GPU may have fallen off the bus: check `dmesg` for Xid 79, drain the node, then reset the GPU (`nvidia-smi --gpu-reset`) or reboot"
    } else if says("no devices were found") || says("no devices found") {
        "nvidia-smi sees no GPU: check the driver and `lspci`, or use backend = \"simulated\" on a machine without GPUs"
    } else if says("insufficient permissions") {
        "run the agent as a user that may open /dev/nvidia*"
    } else {
        "run the same command on the node to see what is wrong"
    }
}

/// The stdout of a successful run, or the failure with nvidia-smi's own words and a hint.
fn expect_success(command: &str, output: SmiOutput) -> Result<String, NvidiaSmiError> {
    if output.exit_code == Some(0) {
        return Ok(output.stdout);
    }
    let printed: Vec<&str> = [output.stderr.trim(), output.stdout.trim()]
        .into_iter()
        .filter(|text| !text.is_empty())
        .collect();
    let printed = if printed.is_empty() {
        "(no output)".to_owned()
    } else {
        printed.join("; ")
    };
    Err(NvidiaSmiError::Failed {
        command: command.to_owned(),
        status: match output.exit_code {
            Some(code) => format!("exit status {code}"),
            None => "killed by a signal".to_owned(),
        },
        hint: failure_hint(&printed),
        output: printed,
    })
}

/// Takes nvidia-smi's problem lines out of what it printed. When they were all that went wrong
/// (nothing else on stderr) and it still answered about other GPUs, the run counts as a
/// success for those; when they were all it printed, it stays a failure.
fn take_output_problems(output: &mut SmiOutput) -> Vec<Problem> {
    let (stdout, stderr) = (output.stdout.clone(), output.stderr.clone());
    let mut problems = take_problems(&mut output.stdout);
    problems.extend(take_problems(&mut output.stderr));
    if problems.is_empty() || output.exit_code == Some(0) {
        return problems;
    }
    if output.stderr.trim().is_empty() && !output.stdout.trim().is_empty() {
        output.exit_code = Some(0);
    } else {
        // The failure's message keeps nvidia-smi's own words.
        output.stdout = stdout;
        output.stderr = stderr;
    }
    problems
}

/// Why a GPU nvidia-smi no longer lists is failed: the problem line naming it, else one naming
/// no GPU, else [`GONE_REASON`].
fn gone_reason(gpu: &GpuInfo, problems: &[Problem]) -> String {
    let address = gpu.pci_bus_id.as_deref().and_then(PciAddress::parse);
    problems
        .iter()
        .find(|p| p.gpu.is_some() && p.gpu == address)
        .or_else(|| problems.iter().find(|p| p.gpu.is_none()))
        .map_or_else(
            || GONE_REASON.to_owned(),
            |p| format!("nvidia-smi: {}", p.line),
        )
}

/// Why every GPU is unknown when nvidia-smi cannot answer.
fn unknown_reason(error: &NvidiaSmiError) -> String {
    match error {
        NvidiaSmiError::TimedOut { timeout, .. } => format!(
            "nvidia-smi did not answer within {} s and was killed: the driver may be stuck or a \
             GPU fell off the bus; check the kernel log for Xid errors",
            timeout.as_secs_f64()
        ),
        other => format!("nvidia-smi failed: {other}"),
    }
}

/// Discovers GPUs with nvidia-smi, through `S`.
pub struct NvidiaSmiBackend<S> {
    source: S,
    /// The fields the GPU query asks for. Optional fields an older driver rejects are dropped
    /// the first time and never asked for again.
    fields: Mutex<Vec<Field>>,
    seen: SeenGpus,
    /// Where fatal Xids are looked for; `None`: not watched.
    kernel_log: Option<KernelLog>,
    /// nvidia-smi could not answer at the last discovery: said once, at WARN, until it answers.
    unanswered: AtomicBool,
}

impl<S: NvidiaSmiSource> NvidiaSmiBackend<S> {
    pub fn new(source: S) -> Self {
        Self {
            source,
            fields: Mutex::new(Field::ALL.to_vec()),
            seen: SeenGpus::default(),
            kernel_log: None,
            unanswered: AtomicBool::new(false),
        }
    }

    /// Also looks for fatal Xid errors in this kernel log (`/dev/kmsg` on a real node).
    pub fn with_kernel_log(mut self, kernel_log: KernelLog) -> Self {
        self.kernel_log = Some(kernel_log);
        self
    }

    /// The GPUs nvidia-smi lists now, plus the ones it listed before, marked failed; every GPU
    /// seen before marked unknown when nvidia-smi cannot answer; GPUs with a fatal Xid marked
    /// failed. An error only when nvidia-smi never answered.
    pub async fn discover_gpus(&self) -> Result<Vec<GpuInfo>, NvidiaSmiError> {
        let xids = self
            .kernel_log
            .as_ref()
            .map(KernelLog::failed_gpus)
            .unwrap_or_default();
        let mut report = match self.ask().await {
            Ok((present, problems)) => {
                if self.unanswered.swap(false, Ordering::Relaxed) {
                    tracing::info!("nvidia-smi answers again.");
                }
                self.seen
                    .report_with(present, |gpu| gone_reason(gpu, &problems))
            }
            Err(error) => {
                let report = self.seen.all_unknown(&unknown_reason(&error));
                if report.is_empty() {
                    return Err(error);
                }
                if !self.unanswered.swap(true, Ordering::Relaxed) {
                    warn!(%error, "nvidia-smi cannot tell; every GPU is reported unknown until it answers.");
                }
                report
            }
        };
        for gpu in &mut report {
            let address = gpu.pci_bus_id.as_deref().and_then(PciAddress::parse);
            if let Some(reason) = address.and_then(|a| xids.get(&a)) {
                gpu.health = GpuHealth::Failed(reason.clone());
            }
        }
        Ok(report)
    }

    /// Asks nvidia-smi for the GPUs: those it lists, and the lines in which it says it cannot
    /// reach one.
    async fn ask(&self) -> Result<(Vec<GpuInfo>, Vec<Problem>), NvidiaSmiError> {
        let (query_command, rows, mut problems) = self.query().await?;
        let list_args = ["-L".to_owned()];
        let list_command = command_line(&list_args);
        let mut list = self.source.run(&list_args).await?;
        problems.extend(take_output_problems(&mut list));
        let list_output = expect_success(&list_command, list)?;
        let listed = parse_list(&list_output).map_err(|source| NvidiaSmiError::Output {
            command: list_command,
            source,
        })?;
        let present = parse::join(rows, &listed).map_err(|source| NvidiaSmiError::Output {
            command: query_command,
            source,
        })?;
        problems.dedup();
        Ok((present, problems))
    }

    /// Runs the GPU query, dropping optional fields the driver does not know. Returns the
    /// command that answered, for messages, its rows and its problem lines.
    async fn query(&self) -> Result<(String, Vec<parse::QueryRow>, Vec<Problem>), NvidiaSmiError> {
        loop {
            let fields = self
                .fields
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let args = [
                query_argument(&fields),
                "--format=csv,noheader,nounits".to_owned(),
            ];
            let command = command_line(&args);
            let mut output = self.source.run(&args).await?;
            let problems = take_output_problems(&mut output);
            let rejected = rejected_field(&output.stdout)
                .or_else(|| rejected_field(&output.stderr))
                .map(|name| (name.to_owned(), Field::from_name(name)));
            if let Some((name, field)) = rejected {
                match field {
                    Some(field) if field.is_optional() && fields.contains(&field) => {
                        warn!(
                            field = name,
                            "This nvidia-smi does not know the field; querying without it."
                        );
                        self.fields
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .retain(|&asked| asked != field);
                        continue;
                    }
                    _ => return Err(NvidiaSmiError::Failed {
                        command,
                        status: "field rejected".to_owned(),
                        output: format!("nvidia-smi does not know the field {name:?}"),
                        hint: "upgrade the NVIDIA driver: ongrid needs uuid, name and memory.total",
                    }),
                }
            }
            let stdout = expect_success(&command, output)?;
            let rows =
                parse_query_gpu(&stdout, &fields).map_err(|source| NvidiaSmiError::Output {
                    command: command.clone(),
                    source,
                })?;
            return Ok((command, rows, problems));
        }
    }
}

impl<S: NvidiaSmiSource> GpuBackend for NvidiaSmiBackend<S> {
    fn kind(&self) -> &'static str {
        "nvidia-smi"
    }

    fn needs_nvidia_runtime(&self) -> bool {
        true
    }

    fn discover(&self) -> BoxFuture<'_, Result<Vec<GpuInfo>, GpuError>> {
        Box::pin(async move { Ok(self.discover_gpus().await?) })
    }

    fn apply_mig<'a>(
        &'a self,
        gpu: &'a GpuInfo,
        layout: ongrid_core::MigLayout,
    ) -> BoxFuture<'a, Result<(), GpuError>> {
        Box::pin(async move {
            self.make_layout(gpu, layout)
                .await
                .map_err(|problem| GpuError::Mig {
                    gpu: gpu.uuid.clone(),
                    layout,
                    problem,
                })
        })
    }

    fn leave_mig<'a>(&'a self, gpu: &'a GpuInfo) -> BoxFuture<'a, Result<(), GpuError>> {
        Box::pin(async move {
            self.turn_mig_off(gpu)
                .await
                .map_err(|problem| GpuError::MigOff {
                    gpu: gpu.uuid.clone(),
                    problem,
                })
        })
    }

    /// Real GPUs start as the manager decides (exclusive until an admin changes it).
    fn start_modes(
        &self,
    ) -> std::collections::BTreeMap<ongrid_core::GpuUuid, ongrid_core::GpuMode> {
        Default::default()
    }
}

/// Whether a failed `mig -dci`/`-dgi` only said there was nothing to destroy.
fn none_found(printed: &str) -> bool {
    let printed = printed.to_ascii_lowercase();
    printed.contains("no ") && printed.contains("found")
}

impl<S: NvidiaSmiSource> NvidiaSmiBackend<S> {
    /// Runs one nvidia-smi command of a MIG change; `Err` with the command and what it printed
    /// when it fails, unless `tolerated` says the failure means "nothing to do".
    async fn mig_step(&self, args: &[String], tolerated: fn(&str) -> bool) -> Result<(), String> {
        let command = command_line(args);
        let output = self.source.run(args).await.map_err(|e| e.to_string())?;
        let printed = format!("{} {}", output.stderr.trim(), output.stdout.trim());
        if output.exit_code == Some(0) && !printed.to_ascii_lowercase().contains("pending") {
            return Ok(());
        }
        if output.exit_code != Some(0) && tolerated(&printed) {
            return Ok(());
        }
        Err(format!("{command}: {}", printed.trim()))
    }

    /// The GPU's compute and GPU instances destroyed (`mig -dci`, `mig -dgi`; none is fine),
    /// then MIG mode off (`-mig 0`; "pending" means a reset or reboot is needed: an error).
    async fn turn_mig_off(&self, gpu: &GpuInfo) -> Result<(), String> {
        let id = gpu.uuid.to_string();
        let args =
            |rest: &[&str]| -> Vec<String> { rest.iter().map(|s| (*s).to_owned()).collect() };
        self.mig_step(&args(&["mig", "-i", &id, "-dci"]), none_found)
            .await?;
        self.mig_step(&args(&["mig", "-i", &id, "-dgi"]), none_found)
            .await?;
        self.mig_step(&args(&["-i", &id, "-mig", "0"]), |_| false)
            .await
            .map_err(|problem| {
                if problem.to_ascii_lowercase().contains("pending") {
                    format!(
                        "{problem} (MIG mode stays on until the GPU is reset: stop what else \
                         holds it and run nvidia-smi -i {id} --gpu-reset, or reboot the node)"
                    )
                } else {
                    problem
                }
            })
    }

    /// MIG mode on (`-mig 1`; "pending" means a reset or reboot is needed: an error), the
    /// GPU's compute and GPU instances destroyed (`mig -dci`, `mig -dgi`; none is fine), then
    /// the layout's GPU instances created with their default compute instances
    /// (`mig -cgi P1,P2,... -C`), in the layout's order.
    async fn make_layout(
        &self,
        gpu: &GpuInfo,
        layout: ongrid_core::MigLayout,
    ) -> Result<(), String> {
        let id = gpu.uuid.to_string();
        let args =
            |rest: &[&str]| -> Vec<String> { rest.iter().map(|s| (*s).to_owned()).collect() };
        if !gpu.mig_enabled {
            self.mig_step(&args(&["-i", &id, "-mig", "1"]), |_| false)
                .await?;
        }
        self.mig_step(&args(&["mig", "-i", &id, "-dci"]), none_found)
            .await?;
        self.mig_step(&args(&["mig", "-i", &id, "-dgi"]), none_found)
            .await?;
        let profiles: Vec<String> = layout.instances().iter().map(ToString::to_string).collect();
        self.mig_step(
            &args(&["mig", "-i", &id, "-cgi", &profiles.join(","), "-C"]),
            |_| false,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use ongrid_core::{ComputeCapability, GpuHealth, GpuUuid};

    use super::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/nvidia-smi/",
                $name
            ))
        };
    }

    const FULL_QUERY: &str = "--query-gpu=uuid,name,memory.total,compute_cap,driver_version,mig.mode.current,pci.bus_id,utilization.gpu --format=csv,noheader,nounits";
    const QUERY_WITHOUT_CAP: &str = "--query-gpu=uuid,name,memory.total,driver_version,mig.mode.current,pci.bus_id,utilization.gpu --format=csv,noheader,nounits";

    fn ok(stdout: &str) -> SmiOutput {
        SmiOutput {
            exit_code: Some(0),
            stdout: stdout.to_owned(),
            stderr: String::new(),
        }
    }

    /// Recorded outputs by command line; the host can be swapped between discoveries. Every
    /// call is logged so tests can see what was asked.
    #[derive(Clone, Default)]
    struct Recorded {
        outputs: Arc<Mutex<HashMap<String, SmiOutput>>>,
        calls: Arc<Mutex<Vec<String>>>,
    }

    impl Recorded {
        fn host(query: &str, list: &str) -> Self {
            let recorded = Self::default();
            recorded.set_host(query, list);
            recorded
        }

        fn set_host(&self, query: &str, list: &str) {
            self.set(FULL_QUERY, ok(query));
            self.set("-L", ok(list));
        }

        fn set(&self, args: &str, output: SmiOutput) {
            self.outputs.lock().unwrap().insert(args.to_owned(), output);
        }

        fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl NvidiaSmiSource for Recorded {
        fn run<'a>(
            &'a self,
            args: &'a [String],
        ) -> BoxFuture<'a, Result<SmiOutput, NvidiaSmiError>> {
            let key = args.join(" ");
            self.calls.lock().unwrap().push(key.clone());
            let output = self.outputs.lock().unwrap().get(&key).cloned();
            Box::pin(async move { Ok(output.unwrap_or_else(|| panic!("no recording for {key}"))) })
        }
    }

    #[tokio::test]
    async fn discovers_a_host_through_the_trait() {
        let backend: Arc<dyn GpuBackend> = Arc::new(NvidiaSmiBackend::new(Recorded::host(
            fixture!("a100x2.query.csv"),
            fixture!("a100x2.list.txt"),
        )));
        assert_eq!(backend.kind(), "nvidia-smi");
        assert!(backend.needs_nvidia_runtime());
        let gpus = backend.discover().await.unwrap();
        assert_eq!(gpus.len(), 2);
        assert!(gpus.iter().all(|gpu| gpu.health.is_healthy()));
        assert!(gpus.iter().all(|gpu| gpu.model == "NVIDIA A100-SXM4-40GB"));
    }

    #[tokio::test]
    async fn a_gpu_that_disappears_is_reported_failed_until_it_returns() {
        let recorded = Recorded::host(fixture!("a100x2.query.csv"), fixture!("a100x2.list.txt"));
        let backend = NvidiaSmiBackend::new(recorded.clone());
        let before = backend.discover_gpus().await.unwrap();

        recorded.set_host(
            fixture!("a100x2-one-gone.query.csv"),
            fixture!("a100x2-one-gone.list.txt"),
        );
        let after = backend.discover_gpus().await.unwrap();
        assert_eq!(after.len(), 2, "the missing GPU is still reported");
        assert_eq!(after[0], before[0]);
        assert_eq!(
            after[1],
            GpuInfo {
                health: GpuHealth::Failed(GONE_REASON.to_owned()),
                utilization_percent: None,
                mig_devices: Vec::new(),
                ..before[1].clone()
            }
        );
        // Still failed at the next discovery, not forgotten.
        assert_eq!(backend.discover_gpus().await.unwrap(), after);

        recorded.set_host(fixture!("a100x2.query.csv"), fixture!("a100x2.list.txt"));
        assert_eq!(backend.discover_gpus().await.unwrap(), before);
    }

    #[tokio::test]
    async fn an_old_driver_is_asked_again_without_compute_cap_once() {
        let recorded = Recorded::default();
        recorded.set(
            FULL_QUERY,
            SmiOutput {
                exit_code: Some(2),
                stdout: fixture!("legacy.query-error.txt").to_owned(),
                stderr: String::new(),
            },
        );
        recorded.set(QUERY_WITHOUT_CAP, ok(fixture!("legacy.query.csv")));
        recorded.set("-L", ok(fixture!("legacy.list.txt")));
        let backend = NvidiaSmiBackend::new(recorded.clone());

        let gpus = backend.discover_gpus().await.unwrap();
        assert_eq!(gpus[0].model, "A100-SXM4-40GB");
        assert_eq!(gpus[0].capability, ComputeCapability::new(8, 0));
        assert!(gpus[0].mig_enabled);
        assert_eq!(gpus[1].capability, ComputeCapability::new(7, 0));
        assert_eq!(recorded.calls(), [FULL_QUERY, QUERY_WITHOUT_CAP, "-L"]);

        backend.discover_gpus().await.unwrap();
        assert_eq!(
            recorded.calls()[3..],
            [QUERY_WITHOUT_CAP, "-L"],
            "the rejected field is remembered"
        );
    }

    #[tokio::test]
    async fn utilisation_is_read_at_every_discovery() {
        let recorded = Recorded::host(fixture!("a100x2.query.csv"), fixture!("a100x2.list.txt"));
        let backend = NvidiaSmiBackend::new(recorded.clone());
        let utilisation = |gpus: &[GpuInfo]| -> Vec<Option<u32>> {
            gpus.iter().map(|gpu| gpu.utilization_percent).collect()
        };
        assert_eq!(
            utilisation(&backend.discover_gpus().await.unwrap()),
            [Some(37), Some(0)]
        );
        recorded.set_host(
            &fixture!("a100x2.query.csv")
                .replace(", 37", ", 100")
                .replace(", 0\n", ", [N/A]\n"),
            fixture!("a100x2.list.txt"),
        );
        assert_eq!(
            utilisation(&backend.discover_gpus().await.unwrap()),
            [Some(100), None]
        );
    }

    #[tokio::test]
    async fn a_rejected_required_field_is_an_error() {
        let recorded = Recorded::default();
        recorded.set(
            FULL_QUERY,
            SmiOutput {
                exit_code: Some(2),
                stdout: "Field \"memory.total\" is not a valid field to query.\n\n".to_owned(),
                stderr: String::new(),
            },
        );
        let err = NvidiaSmiBackend::new(recorded)
            .discover_gpus()
            .await
            .unwrap_err();
        assert!(err.to_string().contains("\"memory.total\""), "{err}");
        assert!(
            err.to_string().contains("upgrade the NVIDIA driver"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn failures_carry_nvidia_smis_words_and_a_hint() {
        let cases = [
            (fixture!("unknown-error.txt"), 15, "fallen off the bus"),
            (fixture!("no-driver.txt"), 9, "lsmod | grep nvidia"),
            ("No devices were found\n", 6, "backend = \"simulated\""),
            ("", 1, "run the same command"),
        ];
        for (printed, code, hint) in cases {
            let recorded = Recorded::default();
            recorded.set(
                FULL_QUERY,
                SmiOutput {
                    exit_code: Some(code),
                    stdout: printed.to_owned(),
                    stderr: String::new(),
                },
            );
            let err = GpuError::from(
                NvidiaSmiBackend::new(recorded)
                    .discover_gpus()
                    .await
                    .unwrap_err(),
            );
            let message = err.to_string();
            assert!(
                message.contains(&format!("exit status {code}")),
                "{message}"
            );
            assert!(message.contains(printed.trim()), "{message}");
            assert!(message.contains(hint), "{message}");
        }
    }

    #[tokio::test]
    async fn a_failing_list_is_an_error_too() {
        let recorded = Recorded::host(fixture!("h100.query.csv"), "");
        recorded.set(
            "-L",
            SmiOutput {
                exit_code: Some(15),
                stdout: String::new(),
                stderr: fixture!("unknown-error.txt").to_owned(),
            },
        );
        let err = NvidiaSmiBackend::new(recorded)
            .discover_gpus()
            .await
            .unwrap_err();
        assert!(
            matches!(&err, NvidiaSmiError::Failed { command, .. } if command == "nvidia-smi -L"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn unparseable_output_names_the_command_and_the_row() {
        let recorded = Recorded::host(
            fixture!("insufficient-permissions.query.csv"),
            fixture!("mig-no-instances.list.txt"),
        );
        let err = NvidiaSmiBackend::new(recorded)
            .discover_gpus()
            .await
            .unwrap_err();
        let NvidiaSmiError::Output { command, source } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(command, &format!("nvidia-smi {FULL_QUERY}"));
        assert!(
            matches!(source, ParseError::MissingValue { line: 1, .. }),
            "{source:?}"
        );
    }

    #[tokio::test]
    async fn every_fixture_host_discovers() {
        let hosts = [
            (fixture!("a100x2.query.csv"), fixture!("a100x2.list.txt"), 2),
            (fixture!("h100.query.csv"), fixture!("h100.list.txt"), 1),
            (
                fixture!("mixed-mig.query.csv"),
                fixture!("mixed-mig.list.txt"),
                2,
            ),
            (
                fixture!("mig-no-instances.query.csv"),
                fixture!("mig-no-instances.list.txt"),
                1,
            ),
            (
                fixture!("special-cells.query.csv"),
                fixture!("special-cells.list.txt"),
                2,
            ),
        ];
        for (query, list, count) in hosts {
            let gpus = NvidiaSmiBackend::new(Recorded::host(query, list))
                .discover_gpus()
                .await
                .unwrap();
            assert_eq!(gpus.len(), count, "{query}");
            let uuids: Vec<GpuUuid> = gpus.iter().map(|gpu| gpu.uuid.clone()).collect();
            let listed: Vec<GpuUuid> = parse_list(list)
                .unwrap()
                .into_iter()
                .map(|gpu| gpu.uuid)
                .collect();
            assert_eq!(uuids, listed, "{query}");
        }
    }

    // ---- the real source, against stand-in executables ----

    /// Writes an executable shell script standing in for nvidia-smi.
    fn script(dir: &std::path::Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// Runs the source, retrying while the script is still open for writing in a process
    /// forked by another test (ETXTBSY), which is a property of the test, not of the code.
    async fn run(source: &RealNvidiaSmi, args: &[&str]) -> Result<SmiOutput, NvidiaSmiError> {
        let args: Vec<String> = args.iter().map(|&arg| arg.to_owned()).collect();
        for _ in 0..50 {
            match source.run(&args).await {
                Err(NvidiaSmiError::Spawn { source, .. }) if source.raw_os_error() == Some(26) => {
                    tokio::task::yield_now().await;
                }
                other => return other,
            }
        }
        source.run(&args).await
    }

    #[tokio::test]
    async fn the_real_source_runs_the_binary() {
        let dir = tempfile::tempdir().unwrap();
        let echo = script(
            dir.path(),
            "echo-smi",
            r#"printf '%s|' "$@"; echo; echo oops >&2; exit 3"#,
        );
        let output = run(&RealNvidiaSmi::new(echo), &["-L", "--format=csv"])
            .await
            .unwrap();
        assert_eq!(
            output,
            SmiOutput {
                exit_code: Some(3),
                stdout: "-L|--format=csv|\n".to_owned(),
                stderr: "oops\n".to_owned(),
            }
        );

        let missing = dir.path().join("no-such-nvidia-smi");
        let err = run(&RealNvidiaSmi::new(missing.clone()), &["-L"])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, NvidiaSmiError::NotFound { path } if *path == missing),
            "{err:?}"
        );

        let not_executable = dir.path().join("not-executable");
        std::fs::write(&not_executable, "").unwrap();
        let err = run(&RealNvidiaSmi::new(not_executable), &["-L"])
            .await
            .unwrap_err();
        assert!(matches!(err, NvidiaSmiError::Spawn { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn a_hung_nvidia_smi_is_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        // `exec` so that the process killed at the timeout is the sleeping one.
        let hung = script(dir.path(), "hung-smi", "exec sleep 600");
        let source = RealNvidiaSmi::new(hung).with_timeout(Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = run(&source, &["-L"]).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(
            matches!(&err, NvidiaSmiError::TimedOut { command, .. } if command == "nvidia-smi -L"),
            "{err:?}"
        );
        assert!(err.to_string().contains("fell off the bus"), "{err}");
    }
}
