"""Notebook 02's exercise checks, and the wrong answers each must catch."""

from exercises import nb02
from helpers import check_tests


# "at least" instead of "more than": one slot early when it divides
def over_or_equal(config, dtype, limit):
    per_token = nb02.step_bytes_solution(config, dtype, 0)
    return -(-limit // per_token) - 1


def over_k_only(config, dtype, limit):  # counts K and forgets V: twice too far
    return 2 * nb02.first_slot_over_solution(config, dtype, limit) + 1


def over_plus_one(config, dtype, limit):  # one slot late
    return nb02.first_slot_over_solution(config, dtype, limit) + 1


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
    (nb02.check_first_slot_over, nb02.first_slot_over_solution,
     [over_or_equal, over_k_only, over_plus_one]),
    (nb02.check_doubling_cache, nb02.DoublingCacheSolution,
     [GrowsByCat, GrowsBy16, ForgetsToCopy, ViewsTheCapacity, ViewsACopy]),
]

test_check = check_tests(nb02, CASES, notes={nb02.check_doubling_cache: "grew"})
