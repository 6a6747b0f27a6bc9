//! A future polled again only once it has asked to be.
//!
//! A `select!` polls every branch each time its task wakes. A run's task wakes once per token
//! for the provider's stream, and its other branch, waiting for a cancel, would each time take
//! the cancellation token's lock and its `Notify`'s lock to learn nothing new. [`when_woken`]
//! gives the inner future a waker of its own and skips polling it until that waker fires.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Wraps `future` so that polling it costs two atomic operations until it wakes its task.
pub fn when_woken<F: Future>(future: F) -> WhenWoken<F> {
    let flag = Arc::new(Flag { woken: AtomicBool::new(true), task: AtomicWaker::new() });
    WhenWoken { future: Box::pin(future), waker: Waker::from(flag.clone()), flag }
}

pub struct WhenWoken<F> {
    future: Pin<Box<F>>,
    flag: Arc<Flag>,
    /// Wakes `flag`, handed to the inner future.
    waker: Waker,
}

struct Flag {
    /// Set when the inner future woke (and before its first poll).
    woken: AtomicBool,
    /// The task polling the wrapper.
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> Future for WhenWoken<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        // Registered before the flag is read: a wake in between finds this task.
        this.flag.task.register(cx.waker());
        if !this.flag.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.future.as_mut().poll(&mut Context::from_waker(&this.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio_util::sync::CancellationToken;

    /// Counts its polls; ready once `ready` is set, waking its last waker when set.
    struct Counted {
        polls: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
        waker: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for Counted {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.ready.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[test]
    fn the_inner_future_is_polled_once_until_it_wakes() {
        let (polls, ready, waker) = (Arc::default(), Arc::new(AtomicBool::new(false)), Arc::default());
        let mut future =
            when_woken(Counted { polls: Arc::clone(&polls), ready: ready.clone(), waker: Arc::clone(&waker) });
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..5 {
            assert!(Pin::new(&mut future).poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled again without having woken");
        ready.store(true, Ordering::SeqCst);
        waker.lock().unwrap().take().expect("registered a waker").wake();
        assert!(Pin::new(&mut future).poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_cancel_reaches_a_task_waiting_in_select() {
        let token = CancellationToken::new();
        let waiting = tokio::spawn({
            let token = token.clone();
            async move {
                let mut cancelled = std::pin::pin!(when_woken(token.cancelled_owned()));
                let mut ticks = 0;
                loop {
                    tokio::select! {
                        biased;
                        () = &mut cancelled => return ticks,
                        () = tokio::time::sleep(std::time::Duration::from_millis(1)) => ticks += 1,
                    }
                }
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        token.cancel();
        let ticks = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.expect("woke").unwrap();
        assert!(ticks > 0, "the select went round while waiting");
    }
}
