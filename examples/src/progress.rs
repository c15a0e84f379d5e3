//! Progress on a terminal. A push: one bar for all its bytes and tensors, and bars for the
//! few largest tensors in flight, so a file of hundreds of tensors draws a handful of lines.
//! A receiver: one line of what has landed, how fast, and what is in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tensorwire::quic::{ReceiverObserver, SendProgress};

/// Tensors drawn with a bar of their own at once: the largest in flight.
pub const MAX_TENSOR_BARS: usize = 4;

/// How often the bars are redrawn.
const TICK: Duration = Duration::from_millis(100);

/// Where one tensor stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TensorState {
    /// Queued or being sent.
    Sending = 0,
    /// Delivered: the receiver confirmed it.
    Delivered = 1,
    /// Failed or cancelled.
    Failed = 2,
}

/// One tensor's state, set by whoever awaits it and read by the bars.
#[derive(Clone, Debug, Default)]
pub struct TensorStatus(Arc<AtomicU8>);

impl TensorStatus {
    /// Records how the tensor ended.
    pub fn set(&self, state: TensorState) {
        self.0.store(state as u8, Ordering::Relaxed);
    }

    fn get(&self) -> TensorState {
        match self.0.load(Ordering::Relaxed) {
            1 => TensorState::Delivered,
            2 => TensorState::Failed,
            _ => TensorState::Sending,
        }
    }
}

/// One tensor as the bars follow it.
struct Tracked {
    name: String,
    progress: SendProgress,
    status: TensorStatus,
}

/// The bars of one push; drawn only on a terminal (stderr), never with `--quiet`.
pub struct PushProgress {
    bars: MultiProgress,
    total: ProgressBar,
    tensor_bars: Vec<ProgressBar>,
    tensor_style: ProgressStyle,
    tensors: Vec<Tracked>,
}

impl PushProgress {
    /// Bars for a push of `total_bytes`; hidden where `draw` is false or stderr is not a
    /// terminal.
    pub fn new(total_bytes: u64, draw: Drawing) -> Self {
        let target = match draw {
            Drawing::OnTerminal => ProgressDrawTarget::stderr(),
            Drawing::Never => ProgressDrawTarget::hidden(),
        };
        let bars = MultiProgress::with_draw_target(target);
        let total = bars.add(ProgressBar::new(total_bytes).with_style(style(
            "{msg:20!} {bar:30} {bytes:>10}/{total_bytes:10} {bytes_per_sec:>12} ETA {eta}",
        )));
        Self {
            bars,
            total,
            tensor_bars: Vec::new(),
            tensor_style: style("  {msg:28!} {bar:30} {bytes:>10}/{total_bytes:10}"),
            tensors: Vec::new(),
        }
    }

    /// Follows one more tensor; its sender sets the returned status when it ends.
    pub fn track(&mut self, name: String, progress: SendProgress) -> TensorStatus {
        let status = TensorStatus::default();
        self.tensors.push(Tracked {
            name,
            progress,
            status: status.clone(),
        });
        status
    }

    /// Starts redrawing, every 100 ms until every tracked tensor has ended.
    pub fn start(self) -> RunningProgress {
        let bars = self.bars.clone();
        let task = tokio::spawn(self.run());
        RunningProgress { bars, task }
    }

    async fn run(mut self) {
        let mut tick = tokio::time::interval(TICK);
        loop {
            tick.tick().await;
            self.redraw();
            if self
                .tensors
                .iter()
                .all(|t| t.status.get() != TensorState::Sending)
            {
                break;
            }
        }
        for bar in self.tensor_bars.drain(..) {
            bar.finish_and_clear();
        }
        self.total.finish();
    }

    fn redraw(&mut self) {
        let (mut bytes, mut done, mut in_flight) = (0, 0, Vec::new());
        for tensor in &self.tensors {
            match tensor.status.get() {
                TensorState::Delivered => {
                    bytes += tensor.progress.total_bytes();
                    done += 1;
                }
                TensorState::Failed => done += 1,
                TensorState::Sending => {
                    let sent = tensor.progress.sent_bytes();
                    bytes += sent;
                    if sent > 0 {
                        in_flight.push(tensor);
                    }
                }
            }
        }
        self.total.set_position(bytes);
        self.total
            .set_message(format!("{done}/{} tensors", self.tensors.len()));
        in_flight.sort_by_key(|t| std::cmp::Reverse(t.progress.total_bytes()));
        in_flight.truncate(MAX_TENSOR_BARS);
        while self.tensor_bars.len() > in_flight.len() {
            if let Some(bar) = self.tensor_bars.pop() {
                bar.finish_and_clear();
                self.bars.remove(&bar);
            }
        }
        while self.tensor_bars.len() < in_flight.len() {
            let bar = ProgressBar::new(0).with_style(self.tensor_style.clone());
            self.tensor_bars.push(self.bars.add(bar));
        }
        for (bar, tensor) in self.tensor_bars.iter().zip(in_flight) {
            bar.set_length(tensor.progress.total_bytes());
            bar.set_position(tensor.progress.sent_bytes());
            bar.set_message(tensor.name.clone());
        }
    }
}

/// Bars being drawn.
pub struct RunningProgress {
    bars: MultiProgress,
    task: tokio::task::JoinHandle<()>,
}

impl RunningProgress {
    /// Writes a line above the bars (or just to stderr where there are none).
    pub fn println(&self, line: &str) {
        self.bars.suspend(|| eprintln!("{line}"));
    }

    /// Waits for the last redraw, once every tensor has ended.
    pub async fn finished(self) {
        let _ = self.task.await;
    }
}

/// Whether bars are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drawing {
    /// On a terminal (stderr) only.
    OnTerminal,
    /// Never (`--quiet`).
    Never,
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// A receiver's one line on a terminal (stderr): tensors landed and failed, bytes, rate,
/// connections open. Ends when dropped.
pub struct ReceiverProgress {
    task: tokio::task::JoinHandle<()>,
    line: ProgressBar,
}

impl ReceiverProgress {
    /// Draws `observer`'s counters every 100 ms, where `draw` allows and stderr is a
    /// terminal.
    pub fn start(observer: ReceiverObserver, draw: Drawing) -> Self {
        let target = match draw {
            Drawing::OnTerminal => ProgressDrawTarget::stderr(),
            Drawing::Never => ProgressDrawTarget::hidden(),
        };
        let line = ProgressBar::with_draw_target(None, target).with_style(style(
            "{spinner} {msg} {bytes:>10} {bytes_per_sec:>12} {elapsed:>4}",
        ));
        let drawn = line.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tick.tick().await;
                let (metrics, open) = (observer.metrics(), observer.open_connections());
                drawn.set_position(metrics.payload_bytes);
                drawn.set_message(format!(
                    "{} tensors landed, {} failed, {} connections",
                    metrics.tensors_completed,
                    metrics.tensors_failed,
                    open.udp + open.tcp
                ));
                drawn.tick();
            }
        });
        Self { task, line }
    }

    /// Writes a line to stdout above the progress line.
    pub fn println(&self, line: &str) {
        self.line.suspend(|| println!("{line}"));
    }

    /// Writes a line to stderr above the progress line.
    pub fn eprintln(&self, line: &str) {
        self.line.suspend(|| eprintln!("{line}"));
    }
}

impl ReceiverProgress {
    /// Stops drawing and clears the line; lines written afterwards go straight out.
    pub fn stop(&self) {
        self.task.abort();
        self.line.finish_and_clear();
    }
}

impl Drop for ReceiverProgress {
    fn drop(&mut self) {
        self.stop();
    }
}
