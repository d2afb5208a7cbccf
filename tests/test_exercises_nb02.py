"""Notebook 02's exercise checks, and the wrong answers each must catch."""

from exercises import nb02
from helpers import check_tests


def _one_slot(config, dtype):  # one layer's K (or V) for one slot
    return config.num_key_value_heads * nb02.head_dim(config) * dtype.itemsize


def peak_is_after(config, dtype, t):  # the cache after the step: forgets the old tensor alive
    return 2 * config.num_hidden_layers * (t + 1) * _one_slot(config, dtype)


def peak_all_old(config, dtype, t):  # every old tensor alive to the end of the step
    return 2 * config.num_hidden_layers * (2 * t + 1) * _one_slot(config, dtype)


def peak_old_k_and_v(config, dtype, t):  # a layer's old K and V both alive at its last write
    return nb02.step_peak_solution(config, dtype, t) + t * _one_slot(config, dtype)


class GrowsByCat(nb02.DoublingCacheSolution):  # a cat cache: allocates at every step
    def write(self, layer, start, k, v):
        for store, new in ((self.k, k), (self.v, v)):
            kept = store[layer][:, :, :start]
            store[layer] = nb02.torch.cat([kept, new.transpose(0, 1)[None]], 2)
        self.held[layer] = start + k.shape[0]


class GrowsBy16(nb02.DoublingCacheSolution):  # a fixed step: still linear in the length
    def write(self, layer, start, k, v):
        end = start + k.shape[0]
        for store, new in ((self.k, k), (self.v, v)):
            old = store[layer]
            if end > old.shape[2]:
                store[layer] = old.new_zeros(1, old.shape[1], end + 16, old.shape[3])
                store[layer][:, :, :start] = old[:, :, :start]
            store[layer][0, :, start:end] = new.transpose(0, 1)
        self.held[layer] = end


class ForgetsToCopy(nb02.DoublingCacheSolution):  # grows into fresh zeros, loses the past
    def write(self, layer, start, k, v):
        end = start + k.shape[0]
        for store, new in ((self.k, k), (self.v, v)):
            old = store[layer]
            if end > old.shape[2]:
                store[layer] = old.new_zeros(1, old.shape[1], max(end, 2 * old.shape[2]),
                                             old.shape[3])
            store[layer][0, :, start:end] = new.transpose(0, 1)
        self.held[layer] = end


class ViewsTheCapacity(nb02.DoublingCacheSolution):  # hands out the unwritten slots too
    def view(self, layer, seq):
        return self.k[layer], self.v[layer]


class ViewsACopy(nb02.DoublingCacheSolution):
    def view(self, layer, seq):
        return self.k[layer][:, :, :seq].clone(), self.v[layer][:, :, :seq].clone()


CASES = [
    (nb02.check_step_peak, nb02.step_peak_solution,
     [peak_is_after, peak_all_old, peak_old_k_and_v]),
    (nb02.check_doubling_cache, nb02.DoublingCacheSolution,
     [GrowsByCat, GrowsBy16, ForgetsToCopy, ViewsTheCapacity, ViewsACopy]),
]

test_check = check_tests(nb02, CASES, notes={nb02.check_doubling_cache: "grew",
                                                 nb02.check_step_peak: "alive at the last write"})
